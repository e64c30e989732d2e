//! CDI specs: driver discovery over fake driver/dev/proc trees, and rendering over simulated
//! inventories.

use gpuplane_model::inventory::Inventory;
use gpuplane_node::cdi::files::DynamicMajors;
use gpuplane_node::cdi::render::{node_devices, render_spec, DeviceRef, NamedDevices};
use gpuplane_node::cdi::*;
use std::fs;
use std::path::{Path, PathBuf};

fn inv(profile: &str) -> Inventory {
    gpuplane_model::sim::load(profile).unwrap()
}

fn touch(path: &Path) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, b"").unwrap();
}

/// A character device with the NVIDIA driver's number for `/dev/<name>` (mknod: root only).
fn node(dev: &Path, name: &str) {
    use gpuplane_testkit::doubles::devnodes::{dynamic_majors, make_node};
    let (uvm, _) = dynamic_majors();
    let (major, minor) = match name {
        "nvidiactl" => (195, 255),
        "nvidia-modeset" => (195, 254),
        "nvidia-uvm" => (uvm, 0),
        "nvidia-uvm-tools" => (uvm, 1),
        gpu => (195, gpu.trim_start_matches("nvidia").parse().unwrap()),
    };
    make_node(&dev.join(name), major, minor).unwrap();
}

fn paths(problems: &[NodeProblem]) -> Vec<PathBuf> {
    problems.iter().map(|p| p.path.clone()).collect()
}

struct Roots {
    _tmp: tempfile::TempDir,
    driver: PathBuf,
    dev: PathBuf,
}

fn roots() -> Roots {
    let tmp = tempfile::tempdir().unwrap();
    let driver = tmp.path().join("driver");
    let dev = tmp.path().join("dev");
    fs::create_dir_all(&driver).unwrap();
    fs::create_dir_all(&dev).unwrap();
    Roots {
        _tmp: tmp,
        driver,
        dev,
    }
}

fn no_caps(_: MigCap) -> Option<u32> {
    None
}

/// gi caps are 100 + gi, ci caps 200 + 10 * gi + ci, per GPU minor offset 1000 * minor.
fn fake_caps(cap: MigCap) -> Option<u32> {
    Some(match cap {
        MigCap::GpuInstance { gpu_minor, gi } => 1000 * gpu_minor + 100 + gi,
        MigCap::ComputeInstance { gpu_minor, gi, ci } => 1000 * gpu_minor + 200 + 10 * gi + ci,
    })
}

fn device<'a>(spec: &'a Spec, name: &str) -> &'a Device {
    spec.devices
        .iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("no device {name}"))
}

fn node_paths(d: &Device) -> Vec<&str> {
    d.container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect()
}

#[test]
fn missing_device_nodes_are_reported() {
    let r = roots();
    let inv = inv("pcie-l4x4");
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    assert!(!files.is_complete());
    let expected: Vec<PathBuf> = [
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia0",
        "nvidia1",
        "nvidia2",
        "nvidia3",
        "nvidiactl",
    ]
    .iter()
    .map(|n| r.dev.join(n))
    .collect();
    assert_eq!(paths(&files.node_problems), expected);
    assert!(files
        .node_problems
        .iter()
        .all(|p| p.fault == NodeFault::Missing));
    let err = files.check_all().unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "{} does not exist yet",
            r.dev.join("nvidia3").display()
        )),
        "{err}"
    );
    // Only the nodes a spec needs are its reasons.
    let gpu1 = r.dev.join("nvidia1");
    let err = files.check_needed(|p| p == gpu1).unwrap_err();
    assert_eq!(paths(&err.problems), vec![gpu1]);

    if !gpuplane_testkit::doubles::devnodes::can_make_nodes() {
        eprintln!("SKIPPED the device-node half: mknod needs root");
        return;
    }
    for n in [
        "nvidiactl",
        "nvidia-uvm",
        "nvidia0",
        "nvidia1",
        "nvidia2",
        "nvidia3",
    ] {
        node(&r.dev, n);
    }
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    assert_eq!(
        paths(&files.node_problems),
        vec![r.dev.join("nvidia-uvm-tools")]
    );
    node(&r.dev, "nvidia-uvm-tools");
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    assert!(files.is_complete(), "{:?}", files.node_problems);
    // nvidia-modeset is optional: absent, it is neither missing nor in the spec.
    assert!(!files
        .control_nodes
        .iter()
        .any(|n| n.container_path.ends_with("nvidia-modeset")));
    // Present but a regular file: left out, not a reason to refuse the GPUs.
    touch(&r.dev.join("nvidia-modeset"));
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    assert!(files.is_complete(), "{:?}", files.node_problems);
    assert!(!files
        .control_nodes
        .iter()
        .any(|n| n.container_path.ends_with("nvidia-modeset")));
    node(&r.dev, "nvidia-modeset");
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    assert!(files
        .control_nodes
        .iter()
        .any(|n| n.container_path == Path::new("/dev/nvidia-modeset")));
}

#[test]
fn device_nodes_that_are_not_what_they_must_be_are_refused_with_the_reason() {
    if !gpuplane_testkit::doubles::devnodes::can_make_nodes() {
        eprintln!("SKIPPED: mknod needs root");
        return;
    }
    let r = roots();
    let inv = inv("pcie-l4x4");
    for n in [
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia1",
        "nvidia2",
    ] {
        node(&r.dev, n);
    }
    // A regular file where /dev/nvidia0 must be, and GPU 3's node with GPU 7's number.
    touch(&r.dev.join("nvidia0"));
    gpuplane_testkit::doubles::devnodes::make_node(&r.dev.join("nvidia3"), 195, 7).unwrap();
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    let (gpu0, gpu3) = (r.dev.join("nvidia0"), r.dev.join("nvidia3"));
    assert_eq!(
        files.node_problems,
        vec![
            NodeProblem {
                path: gpu0.clone(),
                fault: NodeFault::NotCharDevice {
                    kind: "regular file"
                },
            },
            NodeProblem {
                path: gpu3.clone(),
                fault: NodeFault::WrongNumber {
                    found: (195, 7),
                    expected: Expected {
                        major: Some(195),
                        minor: Some(3),
                    },
                },
            },
        ]
    );
    let err = files.check_all().unwrap_err().to_string();
    for reason in [
        format!(
            "{} is a regular file, not a character device",
            gpu0.display()
        ),
        format!("{} has device number 195:7, expected 195:3", gpu3.display()),
    ] {
        assert!(err.contains(&reason), "{err}");
    }
    // A claim on GPU 1 or 2 alone is not held up by them.
    assert!(files.check_needed(|p| p != gpu0 && p != gpu3).is_ok());
}

#[test]
fn simulated_specs_carry_identities_and_need_nothing_from_the_host() {
    let inv = inv("a100-mig-mixed");
    let spec = render_simulated_node_spec(&inv, &Kind::default());
    assert_eq!(spec.cdi_version, "0.5.0", "names start with a digit");
    assert!(
        spec.container_edits.is_empty(),
        "no NVIDIA_VISIBLE_DEVICES=void"
    );
    let gpu0 = &inv.gpus[0];
    let mig = &gpu0.mig_devices[1];
    let whole = format!(
        "GPUPLANE_DEVICE_{}=index={},uuid={},profile=",
        gpu0.index, gpu0.index, gpu0.uuid
    );
    let part = format!(
        "GPUPLANE_DEVICE_{}_MIG_1=index={}:1,uuid={},profile={}",
        gpu0.index, gpu0.index, mig.uuid, mig.profile
    );
    assert_eq!(device(&spec, "0").container_edits.env, vec![whole.clone()]);
    assert_eq!(device(&spec, "0:1").container_edits.env, vec![part.clone()]);
    assert_eq!(
        device(&spec, &mig.uuid).container_edits,
        device(&spec, "0:1").container_edits
    );
    for d in &spec.devices {
        let e = &d.container_edits;
        assert!(
            e.device_nodes.is_empty() && e.mounts.is_empty() && e.hooks.is_empty(),
            "{}",
            d.name
        );
    }
    // `all`: one variable per device, each name once.
    let all = &device(&spec, "all").container_edits.env;
    assert!(all.contains(&whole) && all.contains(&part), "{all:?}");
    let names: std::collections::BTreeSet<&str> = all
        .iter()
        .filter_map(|e| e.split_once('='))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names.len(), all.len());
    assert_eq!(all.len(), inv.gpus.len() + inv.mig_device_count());
    for n in names {
        assert!(
            n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
            "{n} is not a valid environment variable name"
        );
    }
}

#[test]
fn mig_devices_get_cap_nodes() {
    let r = roots();
    let inv = inv("a100-mig-mixed");
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &fake_caps);
    // Cap nodes are expected device nodes too: absent, they are reported.
    assert!(paths(&files.node_problems).contains(&r.dev.join("nvidia-caps/nvidia-cap101")));
    let spec = render_node_spec(&inv, &files, &Kind::default());

    let gpu0 = &inv.gpus[0];
    let mig = &gpu0.mig_devices[1];
    let (gi, ci) = (mig.gpu_instance_id, mig.compute_instance_id);
    let m = device(&spec, "0:1");
    let gi_cap = format!("/dev/nvidia-caps/nvidia-cap{}", 100 + gi);
    let ci_cap = format!("/dev/nvidia-caps/nvidia-cap{}", 200 + 10 * gi + ci);
    let gpu_node = format!("/dev/nvidia{}", gpu0.minor);
    assert_eq!(
        node_paths(m),
        vec![gi_cap.as_str(), ci_cap.as_str(), gpu_node.as_str()]
    );
    assert_eq!(device(&spec, &mig.uuid).container_edits, m.container_edits);
    // Host paths point into the dev root.
    assert_eq!(
        m.container_edits.device_nodes[0].host_path.as_deref(),
        Some(
            r.dev
                .join(format!("nvidia-caps/nvidia-cap{}", 100 + gi))
                .to_str()
                .unwrap()
        )
    );

    // The whole GPU gets only its own node; `all` gets every node once.
    assert_eq!(node_paths(device(&spec, "0")), vec![gpu_node.as_str()]);
    let all = device(&spec, "all");
    let mut expected: Vec<String> = inv
        .gpus
        .iter()
        .map(|g| format!("/dev/nvidia{}", g.minor))
        .collect();
    for g in &inv.gpus {
        for m in &g.mig_devices {
            let (gi, ci) = (m.gpu_instance_id, m.compute_instance_id);
            expected.push(format!(
                "/dev/nvidia-caps/nvidia-cap{}",
                1000 * g.minor + 100 + gi
            ));
            expected.push(format!(
                "/dev/nvidia-caps/nvidia-cap{}",
                1000 * g.minor + 200 + 10 * gi + ci
            ));
        }
    }
    expected.sort();
    expected.dedup();
    assert_eq!(node_paths(all), expected);

    // Unknown minors: no cap nodes, the device still has its parent's node.
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    assert!(files.mig_cap_nodes.is_empty());
    let spec = render_node_spec(&inv, &files, &Kind::default());
    assert_eq!(node_paths(device(&spec, "0:1")), vec![gpu_node.as_str()]);
}

/// With the `nvidia-caps` major known (`/proc/devices` lists it on every host with NVIDIA's
/// driver loaded), a MIG device's access nodes go into specs by number, for the runtime to make
/// in the container: the host has none of them (an instance made at NodePrepare never has one),
/// and none is reported missing.
#[test]
fn mig_cap_nodes_go_by_number_where_the_major_is_known() {
    const CAPS_MAJOR: u64 = 237;
    let r = roots();
    let inv = inv("a100-mig-mixed");
    let majors = DynamicMajors {
        uvm: None,
        caps: Some(CAPS_MAJOR),
    };
    let files = driver::discover_checked(&r.driver, &r.dev, &inv, &fake_caps, majors);
    assert!(
        !paths(&files.node_problems)
            .iter()
            .any(|p| p.starts_with(r.dev.join("nvidia-caps"))),
        "{:?}",
        files.node_problems
    );
    let spec = render_node_spec(&inv, &files, &Kind::default());
    let mig = &inv.gpus[0].mig_devices[1];
    let (gi, ci) = (mig.gpu_instance_id, mig.compute_instance_id);
    let caps: Vec<&DeviceNode> = device(&spec, "0:1")
        .container_edits
        .device_nodes
        .iter()
        .filter(|n| n.path.starts_with("/dev/nvidia-caps/"))
        .collect();
    let by_number = |minor: u32| DeviceNode {
        path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
        node_type: Some("c".into()),
        major: Some(CAPS_MAJOR as i64),
        minor: Some(i64::from(minor)),
        ..Default::default()
    };
    assert_eq!(caps, [&by_number(100 + gi), &by_number(200 + 10 * gi + ci)]);
    // Type, major and minor are cdiVersion 0.3.0 fields: podman 4.3 (at most 0.5.0) reads it.
    assert_eq!(
        spec.cdi_version, "0.5.0",
        "the dev root's host paths need 0.5.0"
    );
    let mut without_host_paths = spec.clone();
    // Names starting with a digit (`0:1`) need 0.5.0 too; the UUID names remain.
    without_host_paths
        .devices
        .retain(|d| d.name.starts_with(|c: char| c.is_ascii_alphabetic()));
    for d in &mut without_host_paths.devices {
        d.container_edits
            .device_nodes
            .retain(|n| n.host_path.is_none());
    }
    without_host_paths.container_edits.device_nodes.clear();
    assert_eq!(minimum_version(&without_host_paths), "0.3.0");
}

#[test]
fn node_spec_names_every_device() {
    let inv = inv("a100-mig-mixed");
    let files = DriverFiles::empty(Path::new("/"), Path::new("/dev"));
    let spec = render_node_spec(&inv, &files, &Kind::default());
    assert_eq!(spec.kind, "nvidia.com/gpu");
    let mut expected = vec!["all".to_string()];
    for g in &inv.gpus {
        expected.push(g.index.to_string());
        expected.push(g.uuid.to_string());
        for (i, m) in g.mig_devices.iter().enumerate() {
            expected.push(format!("{}:{i}", g.index));
            expected.push(m.uuid.to_string());
        }
    }
    expected.sort();
    let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, expected);
    // Every name is a valid CDI name and gives a valid qualified name.
    for n in &names {
        let q: QualifiedName = format!("nvidia.com/gpu={n}").parse().unwrap();
        assert_eq!(q.name.as_str(), *n);
    }
    // Names starting with a digit need 0.5.0 even without hostPath.
    assert!(spec
        .devices
        .iter()
        .flat_map(|d| &d.container_edits.device_nodes)
        .all(|n| n.host_path.is_none()));
    assert_eq!(spec.cdi_version, "0.5.0");
    // Deterministic.
    assert_eq!(
        writer::spec_bytes(&spec).unwrap(),
        writer::spec_bytes(&render_node_spec(&inv, &files, &Kind::default())).unwrap()
    );
    assert_eq!(
        spec.container_edits.env,
        vec!["NVIDIA_VISIBLE_DEVICES=void"]
    );
}

#[test]
fn claim_style_specs_reuse_the_building_block() {
    let inv = inv("pcie-l4x4");
    let files = DriverFiles::empty(Path::new("/"), Path::new("/dev"));
    let kind: Kind = "gpuplane.dev/claim".parse().unwrap();
    let devices = vec![NamedDevices {
        name: DeviceName::new("claim-8f2e").unwrap(),
        devices: vec![DeviceRef::Gpu(&inv.gpus[2]), DeviceRef::Gpu(&inv.gpus[0])],
    }];
    let spec = render_spec(&kind, &devices, &files);
    assert_eq!(spec.kind, "gpuplane.dev/claim");
    // Letters first, no hostPath: the oldest version fits.
    assert_eq!(spec.cdi_version, "0.3.0");
    assert_eq!(spec.devices.len(), 1);
    assert_eq!(
        node_paths(&spec.devices[0]),
        vec!["/dev/nvidia0", "/dev/nvidia2"]
    );

    // A repeated name keeps its first entry.
    let mut twice = devices.clone();
    twice.push(NamedDevices {
        name: DeviceName::new("claim-8f2e").unwrap(),
        devices: vec![DeviceRef::Gpu(&inv.gpus[3])],
    });
    assert_eq!(render_spec(&kind, &twice, &files), spec);
    assert_eq!(node_devices(&inv).len(), 4 * 2 + 1);
}

#[test]
fn the_node_spec_lists_a_dynamic_gpu_but_not_the_instances_made_on_it_for_claims() {
    let mut inv = inv("a100-mig-mixed");
    let gpu = inv
        .gpus
        .iter()
        .position(|g| !g.mig_devices.is_empty())
        .unwrap();
    let names = |inv: &Inventory| -> Vec<String> {
        node_devices(inv)
            .iter()
            .map(|d| d.name.to_string())
            .collect()
    };
    let instance = inv.gpus[gpu].mig_devices[0].uuid.to_string();
    assert!(names(&inv).contains(&instance));
    inv.gpus[gpu].mig.dynamic = true;
    let listed = names(&inv);
    assert!(!listed.contains(&instance), "{listed:?}");
    assert!(listed.contains(&inv.gpus[gpu].uuid.to_string()));
    assert!(!listed.iter().any(|n| n.starts_with(&format!("{gpu}:"))));
}

/// Lays out a driver root with libraries in two directories, links and decoys.
fn fake_driver(root: &Path) {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    fs::create_dir_all(&lib).unwrap();
    for f in [
        "libnvidia-ml.so.550.90.07",
        "libcuda.so.550.90.07",
        "libcuda.so.535.183.01", // stale leftover: the driver's version wins
        "libnvidia-ptxjitcompiler.so.550.90.07",
        "libcudart.so.12.4.127",          // not a driver library
        "libnvidia-ml.so.550.90.07.orig", // not a version
    ] {
        fs::write(lib.join(f), f).unwrap();
    }
    std::os::unix::fs::symlink("libcuda.so.550.90.07", lib.join("libcuda.so.1")).unwrap();
    std::os::unix::fs::symlink("libcuda.so.1", lib.join("libcuda.so")).unwrap();
    let lib64 = root.join("usr/lib64");
    fs::create_dir_all(&lib64).unwrap();
    fs::write(lib64.join("libnvidia-nvvm.so.4.0.0"), b"").unwrap();
    fs::write(lib64.join("libnvidia-ml.so.550.90.07"), b"").unwrap(); // shadowed by the first dir
    std::os::unix::fs::symlink("usr/lib64", root.join("lib64")).unwrap(); // scanned once
    let bin = root.join("usr/bin");
    fs::create_dir_all(&bin).unwrap();
    for b in ["nvidia-smi", "nvidia-debugdump", "nvidia-ctk", "unrelated"] {
        fs::write(bin.join(b), b"#!/bin/sh\n").unwrap();
    }
    fs::create_dir_all(root.join("bin")).unwrap();
    fs::write(root.join("bin/nvidia-persistenced"), b"").unwrap();
}

#[test]
fn discovers_libraries_binaries_and_hook() {
    let r = roots();
    fake_driver(&r.driver);
    let inv = inv("pcie-l4x4");
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    let libs: Vec<&Path> = files
        .libraries
        .iter()
        .map(|l| l.container_path.as_path())
        .collect();
    assert_eq!(
        libs,
        vec![
            Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07"),
            Path::new("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.90.07"),
            Path::new("/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.550.90.07"),
            Path::new("/usr/lib64/libnvidia-nvvm.so.4.0.0"),
        ]
    );
    for l in &files.libraries {
        assert_eq!(
            l.host_path,
            r.driver.join(l.container_path.strip_prefix("/").unwrap())
        );
    }
    let bins: Vec<&Path> = files
        .binaries
        .iter()
        .map(|b| b.container_path.as_path())
        .collect();
    assert_eq!(
        bins,
        vec![
            Path::new("/usr/bin/nvidia-debugdump"),
            Path::new("/bin/nvidia-persistenced"),
            Path::new("/usr/bin/nvidia-smi"),
        ]
    );
    assert_eq!(
        files.ldcache_hook,
        Some(r.driver.join("usr/bin/nvidia-ctk"))
    );

    let spec = render_node_spec(&inv, &files, &Kind::default());
    let e = &spec.container_edits;
    assert_eq!(e.mounts.len(), 7);
    assert!(e
        .mounts
        .iter()
        .all(|m| m.options == ["ro", "nosuid", "nodev", "bind"]));
    let smi = e
        .mounts
        .iter()
        .find(|m| m.container_path == "/usr/bin/nvidia-smi")
        .unwrap();
    assert_eq!(
        smi.host_path,
        r.driver.join("usr/bin/nvidia-smi").to_str().unwrap()
    );
    let hook = &e.hooks[0];
    assert_eq!(hook.hook_name, "createContainer");
    assert_eq!(
        hook.path,
        r.driver.join("usr/bin/nvidia-ctk").to_str().unwrap()
    );
    assert_eq!(
        hook.args,
        [
            "nvidia-ctk",
            "hook",
            "update-ldcache",
            "--folder",
            "/usr/lib/x86_64-linux-gnu",
            "--folder",
            "/usr/lib64"
        ]
    );
    // The dedicated hook binary is preferred and takes no `hook` subcommand.
    fs::write(r.driver.join("usr/bin/nvidia-cdi-hook"), b"").unwrap();
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    let spec = render_node_spec(&inv, &files, &Kind::default());
    assert_eq!(
        spec.container_edits.hooks[0].args[..2],
        ["nvidia-cdi-hook", "update-ldcache"]
    );
    // Device nodes outside /dev need hostPath: 0.5.0 (which podman 4.3 still reads).
    assert!(spec.container_edits.device_nodes[0].host_path.is_some());
    assert_eq!(spec.cdi_version, spec::PODMAN_4_3_MAX);
}

#[test]
fn no_libraries_no_hook() {
    let r = roots();
    let bin = r.driver.join("usr/bin");
    fs::create_dir_all(&bin).unwrap();
    fs::write(bin.join("nvidia-cdi-hook"), b"").unwrap();
    let inv = inv("pcie-l4x4");
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    assert!(files.ldcache_hook.is_some());
    let spec = render_node_spec(&inv, &files, &Kind::default());
    assert!(spec.container_edits.hooks.is_empty());
    assert!(spec.container_edits.mounts.is_empty());
}

#[test]
fn falls_back_to_the_highest_library_version() {
    let r = roots();
    let lib = r.driver.join("usr/lib64");
    fs::create_dir_all(&lib).unwrap();
    for f in ["libcuda.so.535.9.1", "libcuda.so.535.10.0"] {
        fs::write(lib.join(f), b"").unwrap();
    }
    let inv = inv("pcie-l4x4"); // driver 550.90.07: neither matches
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    assert_eq!(files.libraries.len(), 1);
    assert!(files.libraries[0]
        .container_path
        .ends_with("libcuda.so.535.10.0"));
}

#[test]
fn invalid_inventory_names_are_skipped() {
    let mut inv = inv("pcie-l4x4");
    // A UUID NVML may give (the legacy MIG form) that CDI does not take as a device name.
    inv.gpus[1].uuid = "MIG-GPU-abc/1/0".parse().unwrap();
    let files = DriverFiles::empty(Path::new("/"), Path::new("/dev"));
    let spec = render_node_spec(&inv, &files, &Kind::default());
    assert!(spec
        .devices
        .iter()
        .all(|d| d.name.parse::<DeviceName>().is_ok()));
    assert!(spec.devices.iter().any(|d| d.name == "1"));
    assert_eq!(spec.devices.len(), 4 * 2 + 1 - 1);
}

#[test]
fn written_node_spec_is_unchanged_on_rewrite() {
    let r = roots();
    let inv = inv("pcie-l4x4");
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps);
    let spec = render_node_spec(&inv, &files, &Kind::default());
    let cdi = r.driver.join("cdi");
    assert_eq!(
        write_spec(&cdi, "gpuplane", &spec, Durability::Durable).unwrap(),
        WriteOutcome::Written
    );
    let again = render_node_spec(&inv, &files, &Kind::default());
    assert_eq!(
        write_spec(&cdi, "gpuplane", &again, Durability::Durable).unwrap(),
        WriteOutcome::Unchanged
    );
}

#[test]
fn a_driver_found_under_a_mount_is_named_as_the_host_sees_it() {
    // A host-installed driver: the agent sees the host's / at <driver>, the runtime at /.
    let r = roots();
    fake_driver(&r.driver);
    let inv = inv("pcie-l4x4");
    let files = driver::discover_with(&r.driver, &r.dev, &inv, &no_caps)
        .seen_from_host(&r.driver, Path::new("/"));
    assert!(!files.libraries.is_empty());
    for f in files.libraries.iter().chain(&files.binaries) {
        assert_eq!(f.host_path, f.container_path, "{f:?}");
    }
    assert_eq!(
        files.ldcache_hook.as_deref(),
        Some(Path::new("/usr/bin/nvidia-ctk"))
    );
    // Device nodes are not under the driver root and keep their paths.
    assert!(files
        .control_nodes
        .iter()
        .all(|n| n.host_path.starts_with(&r.dev)));
    let spec = render_node_spec(&inv, &files, &Kind::default());
    assert!(spec
        .container_edits
        .mounts
        .iter()
        .any(|m| m.host_path == "/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07"));
}
