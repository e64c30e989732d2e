//! podman runs a container with the devices of a node spec rendered directly.

use super::*;

#[test]
fn podman_injects_a_rendered_spec() {
    if lacks_prerequisites() {
        return;
    }
    let id = unique_id();
    let tmp = tempfile::tempdir().unwrap();
    let driver_root = tmp.path().join("driver");
    let dev_root = tmp.path().join("dev");
    fake_driver_root(&driver_root);
    fs::create_dir_all(&dev_root).unwrap();

    let inv = gpuplane_model::sim::load("pcie-l4x4").unwrap();

    // Before the nodes exist the agent must not write the spec.
    let proc = cdi::ProcCaps::new(&HostPaths::standard().proc_root);
    let files = cdi::driver::discover_proc(&driver_root, &dev_root, &inv, &proc);
    assert!(!files.is_complete());
    make_dev_nodes(&dev_root, inv.gpus.iter().map(|g| g.minor));
    let files = cdi::driver::discover_proc(&driver_root, &dev_root, &inv, &proc);
    assert!(files.is_complete(), "{:?}", files.node_problems);

    let kind: Kind = format!("test-{id}.gpuplane.dev/gpu").parse().unwrap();
    let spec = cdi::render_node_spec(&inv, &files, &kind);
    assert_eq!(spec.cdi_version, "0.5.0", "podman 4.3 reads at most 0.5.0");

    let stem = format!("gpuplane-test-{id}");
    let mut cleanup = Cleanup {
        stems: vec![stem.clone()],
        image: None,
    };
    assert_eq!(
        cdi::write_spec(Path::new(CDI_ROOT), &stem, &spec, cdi::Durability::Durable).unwrap(),
        WriteOutcome::Written
    );
    assert_eq!(
        cdi::write_spec(Path::new(CDI_ROOT), &stem, &spec, cdi::Durability::Durable).unwrap(),
        WriteOutcome::Unchanged
    );
    let spec_file = spec_file(&stem);
    assert!(spec_file.is_file());

    let image = busybox_image(tmp.path(), &id, &mut cleanup);

    let device = format!("{kind}=0");
    let script = format!(
        "ls -l /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm; cat {NVML_LIB}; \
         nvidia-smi; /usr/bin/nvidia-smi; echo VIS=$NVIDIA_VISIBLE_DEVICES; \
         test -e /dev/nvidia1 && echo LEAKED-nvidia1; true"
    );
    let stdout = run_with_device(&device, &image, &script);
    let (uvm, _) = devnodes::dynamic_majors();
    for (node, major, minor) in [
        ("/dev/nvidia0", 195, u64::from(inv.gpus[0].minor)),
        ("/dev/nvidiactl", 195, 255),
        ("/dev/nvidia-uvm", uvm, 0),
    ] {
        assert_char_device(&stdout, node, major, minor);
    }
    assert!(stdout.contains(NVML_MARKER), "{stdout}");
    assert!(stdout.contains(SMI_MARKER), "{stdout}");
    assert!(stdout.contains("VIS=void"), "{stdout}");
    assert!(
        !stdout.contains("LEAKED"),
        "device 1 was not requested:\n{stdout}"
    );

    // By UUID too, as NVIDIA's specs allow.
    let by_uuid = format!("{kind}={}", inv.gpus[2].uuid);
    assert!(run_with_device(&by_uuid, &image, "ls /dev/nvidia2").contains("/dev/nvidia2"));

    // A device the spec does not define is refused.
    assert_unresolvable(&format!("{kind}=9"), &image);

    drop(cleanup);
    assert!(!spec_file.exists());
}
