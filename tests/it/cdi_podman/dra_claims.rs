//! podman runs containers with the per-claim specs the running agent's DRA driver writes:
//! a prepared claim, and a dynamic-MIG container given the access nodes the host lacks.

use super::*;

/// A claim `name` allocated (by the absent scheduler) to `device` of this node, with the
/// opaque `config` for `driver` in its allocation.
fn allocated_claim(lab: &Lab, driver: &str, name: &str, device: &str, config: Value) -> ClaimRef {
    let namespace = "team-a";
    let obj = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": driver, "count": 1}}]}},
        "status": {"allocation": {"devices": {
            "results": [{"request": "gpus", "driver": driver, "pool": NODE, "device": device}],
            "config": config
        }}}
    });
    let stored = lab.api.put_json(obj).unwrap();
    ClaimRef::parse(namespace, stored["metadata"]["uid"].as_str().unwrap(), name).unwrap()
}

/// [`allocated_claim`] with a time-slicing `GpuConfig`.
fn time_sliced_claim(lab: &Lab, driver: &str, device: &str) -> ClaimRef {
    let config = json!([{"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing"}}}}]);
    allocated_claim(lab, driver, "shared", device, config)
}

/// A `/proc` as NVIDIA's kernel driver fills it, for GPUs of `minors`: `devices` lists
/// `nvidia-caps` at `caps_major`, and `driver/nvidia-caps/mig-minors` has a minor for every GPU
/// and compute instance that could ever exist (the driver writes it at load: 15 GPU instances
/// of 8 compute instances each per GPU), so an instance made later already has its minors.
fn fake_proc(root: &Path, minors: impl IntoIterator<Item = u32>, caps_major: u64) {
    fs::create_dir_all(root.join("sys/kernel/random")).unwrap();
    fs::write(root.join("sys/kernel/random/boot_id"), "boot-1\n").unwrap();
    fs::write(
        root.join("devices"),
        format!("Character devices:\n195 nvidia\n{caps_major} nvidia-caps\n"),
    )
    .unwrap();
    let mut text = String::from("config 1\nmonitor 2\n");
    let mut next = 3;
    for gpu in minors {
        for gi in 0..15 {
            text.push_str(&format!("gpu{gpu}/gi{gi}/access {next}\n"));
            next += 1;
            for ci in 0..8 {
                text.push_str(&format!("gpu{gpu}/gi{gi}/ci{ci}/access {next}\n"));
                next += 1;
            }
        }
    }
    fs::create_dir_all(root.join("driver/nvidia-caps")).unwrap();
    fs::write(root.join("driver/nvidia-caps/mig-minors"), text).unwrap();
}

/// Dynamic MIG on hardware: the instance NodePrepareResources makes has no
/// `/dev/nvidia-caps` node on the host (nothing creates one), yet the container sees both its
/// access nodes, GPU instance and compute instance, with the numbers `/proc` gives: the spec
/// names them by number and runc makes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_gives_a_dynamic_mig_container_the_access_nodes_the_host_lacks() {
    if lacks_prerequisites() {
        return;
    }
    const CAPS_MAJOR: u64 = 237;
    let id = unique_id();
    let driver = format!("t{id}.gpuplane.dev");
    let lab = Lab::new("dynamic-mig-mixed").await;
    let inv = lab.sim.discover().unwrap().inventory;
    let d = lab.dir.path();
    let (driver_root, dev_root, proc_root) = (d.join("driver"), d.join("devnodes"), d.join("proc"));
    fake_driver_root(&driver_root);
    // Every GPU node but the last (no node-wide spec in /var/run/cdi, module docs).
    let minors: Vec<u32> = inv.gpus.iter().map(|g| g.minor).collect();
    make_dev_nodes(&dev_root, minors[..minors.len() - 1].iter().copied());
    fake_proc(&proc_root, minors.iter().copied(), CAPS_MAJOR);
    let mut cleanup = Cleanup::default();
    let image = busybox_image(d, &id, &mut cleanup);
    let host = Host {
        cdi_root: Path::new(CDI_ROOT),
        dev_root: &dev_root,
        driver_root: &driver_root,
        proc_root: Some(&proc_root),
        config: "dynamicMig:\n  gpus: [0]\n",
    };
    let agent = Agent::start(&lab, &driver, host, DeviceMode::Hardware);
    lab.dra.wait_registered(&driver, WAIT).await.unwrap();
    let device = "gpu-0-mig-3g40gb-at4";
    let claim = allocated_claim(&lab, &driver, "dynamic", device, json!([]));
    let stem = format!("gpuplane-claim-{}", claim.uid);
    cleanup.stems.push(stem.clone());
    let devices = prepare_claim(&lab, &driver, &claim).await;
    let cdi_id = format!("k8s.{driver}/claim={}-{device}", claim.uid);
    assert_eq!(devices[0].cdi_ids, std::slice::from_ref(&cdi_id));

    // The instance the prepare made, and the minors /proc gives for it.
    let mig = lab.sim.discover().unwrap().inventory.gpus[0].mig_devices[0].clone();
    let proc = cdi::ProcCaps::new(&proc_root);
    let minor = |cap| proc.minor(cap).unwrap();
    let gpu_minor = inv.gpus[0].minor;
    let (gi, ci) = (mig.gpu_instance_id, mig.compute_instance_id);
    let gi_minor = minor(cdi::files::MigCap::GpuInstance { gpu_minor, gi });
    let ci_minor = minor(cdi::files::MigCap::ComputeInstance { gpu_minor, gi, ci });
    assert!(
        !dev_root.join("nvidia-caps").exists(),
        "the host has no access nodes"
    );

    let script = format!(
        "ls -l /dev/nvidia-caps/ /dev/nvidia{gpu_minor}; ls /dev/nvidia-caps | grep -c cap"
    );
    let stdout = run_with_device(&cdi_id, &image, &script);
    assert_char_device(
        &stdout,
        &format!("nvidia-cap{gi_minor}"),
        CAPS_MAJOR,
        u64::from(gi_minor),
    );
    assert_char_device(
        &stdout,
        &format!("nvidia-cap{ci_minor}"),
        CAPS_MAJOR,
        u64::from(ci_minor),
    );
    assert_char_device(
        &stdout,
        &format!("/dev/nvidia{gpu_minor}"),
        195,
        u64::from(gpu_minor),
    );
    assert_eq!(
        stdout.lines().last(),
        Some("2"),
        "only its own two access nodes:\n{stdout}"
    );

    unprepare_claim(&lab, &driver, &claim).await;
    assert!(lab.sim.discover().unwrap().inventory.gpus[0]
        .mig_devices
        .is_empty());
    agent.stop().await;
    drop(cleanup);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_a_container_with_the_spec_of_a_prepared_dra_claim() {
    if lacks_prerequisites() {
        return;
    }
    let started = Instant::now();
    let id = unique_id();
    let driver = format!("t{id}.gpuplane.dev");
    let lab = Lab::new("dgx-h100").await;
    let inv = lab.sim.discover().unwrap().inventory;
    assert_eq!(
        inv.driver_version, "550.90.07",
        "the library below is named for it"
    );
    let driver_root = lab.dir.path().join("driver");
    let dev_root = lab.dir.path().join("devnodes");
    fake_driver_root(&driver_root);
    // Every node but the last GPU's (see the module docs): no node-wide spec.
    let minors: Vec<u32> = inv.gpus[..inv.gpus.len() - 1]
        .iter()
        .map(|g| g.minor)
        .collect();
    assert_eq!(minors, (0..7).collect::<Vec<_>>());
    make_dev_nodes(&dev_root, minors);

    let node_stem = gpuplane_node::cdi::node_spec::NODE_SPEC_STEM;
    let node_spec_was_there = spec_file(node_stem).exists();
    let mut cleanup = Cleanup::default();
    if !node_spec_was_there {
        cleanup.stems.push(node_stem.into());
    }
    let image = busybox_image(lab.dir.path(), &id, &mut cleanup);

    let host = Host {
        cdi_root: Path::new(CDI_ROOT),
        dev_root: &dev_root,
        driver_root: &driver_root,
        proc_root: None,
        config: "",
    };
    let agent = Agent::start(&lab, &driver, host, DeviceMode::Hardware);
    lab.dra.wait_registered(&driver, WAIT).await.unwrap();
    let claim = time_sliced_claim(&lab, &driver, "gpu-2");
    let stem = format!("gpuplane-claim-{}", claim.uid);
    cleanup.stems.push(stem.clone());

    let devices = prepare_claim(&lab, &driver, &claim).await;
    let kind = format!("k8s.{driver}/claim");
    let cdi_id = format!("{kind}={}-gpu-2", claim.uid);
    let ids: Vec<&str> = devices
        .iter()
        .flat_map(|d| d.cdi_ids.iter().map(String::as_str))
        .collect();
    assert_eq!(ids, [cdi_id.as_str()]);
    let spec: Value = serde_json::from_slice(&fs::read(spec_file(&stem)).unwrap()).unwrap();
    assert_eq!(spec["kind"], kind.as_str(), "{spec:#}");
    if !node_spec_was_there {
        assert!(
            !spec_file(node_stem).exists(),
            "the agent wrote a node-wide nvidia.com/gpu spec into {CDI_ROOT}"
        );
    }

    let script = format!(
        "ls -l /dev/nvidia2 /dev/nvidiactl; env | grep GPUPLANE; cat {NVML_LIB}; \
         test -e /dev/nvidia3 && echo LEAKED-nvidia3; true"
    );
    let stdout = run_with_device(&cdi_id, &image, &script);
    for (node, minor) in [("/dev/nvidia2", 2), ("/dev/nvidiactl", 255)] {
        assert_char_device(&stdout, node, 195, minor);
    }
    let env: Vec<&str> = stdout.lines().filter(|l| l.contains('=')).collect();
    assert!(
        env.contains(&"GPUPLANE_SHARING_STRATEGY=TimeSlicing"),
        "{stdout}"
    );
    assert!(stdout.lines().any(|l| l == NVML_MARKER), "{stdout}");
    assert!(
        !stdout.contains("LEAKED"),
        "gpu-3 was not allocated:\n{stdout}"
    );

    unprepare_claim(&lab, &driver, &claim).await;
    assert!(
        !spec_file(&stem).exists(),
        "unprepare left the claim's spec"
    );
    assert_unresolvable(&cdi_id, &image);

    agent.stop().await;
    drop(cleanup);
    eprintln!("cdi_podman DRA claim test took {:?}", started.elapsed());
}
