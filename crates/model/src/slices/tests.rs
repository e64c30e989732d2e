use super::plan::{plan, Echoes};
use super::render::{pci_address, pcie_roots, semver, DEVICES_PER_SLICE};
use super::*;
use crate::health::HealthBook;
use crate::inventory::{DeviceUuid, Inventory};
use crate::source::DeviceEvent;
use k8s_openapi::api::resource::v1::{DeviceAttribute, DeviceTaint, ResourceSlice};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub(super) const DRIVER: &str = "gpu.gpuplane.dev";
pub(super) const NODE: &str = "node-a";

pub(super) fn book(inv: &Inventory) -> HealthBook {
    let mut b = HealthBook::default();
    b.set_inventory(inv);
    b
}

pub(super) fn devices(slices: &[ResourceSlice]) -> Vec<&k8s_openapi::api::resource::v1::Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect()
}

pub(super) fn attr<'a>(
    d: &'a k8s_openapi::api::resource::v1::Device,
    name: &str,
) -> &'a DeviceAttribute {
    d.attributes
        .as_ref()
        .and_then(|a| a.get(name))
        .unwrap_or_else(|| panic!("{} has no attribute {name}", d.name))
}

pub(super) fn s(v: &DeviceAttribute) -> &str {
    v.string
        .as_deref()
        .or(v.version.as_deref())
        .unwrap_or("<not a string>")
}

/// `n` copies of a profile's GPUs, renumbered, without topology.
pub(super) fn synthetic(profile: &str, copies: u32) -> Inventory {
    let base = crate::sim::load(profile).unwrap();
    let mut inv = base.clone();
    inv.gpus.clear();
    inv.topology.links.clear();
    for c in 0..copies {
        for g in &base.gpus {
            let mut g = g.clone();
            g.index += c * base.gpus.len() as u32;
            g.minor = g.index;
            g.uuid = DeviceUuid::parse(format!("GPU-{:08x}-0000-0000-0000-000000000000", g.index))
                .unwrap();
            g.pci_bus_id = format!("{:08X}:{:02X}:00.0", g.index / 200, g.index % 200);
            for (k, m) in g.mig_devices.iter_mut().enumerate() {
                m.uuid = DeviceUuid::parse(format!(
                    "MIG-{:08x}-{k:04x}-0000-0000-000000000000",
                    g.index
                ))
                .unwrap();
                m.parent_uuid = g.uuid.clone();
            }
            inv.gpus.push(g);
        }
    }
    inv
}

#[test]
fn every_bundled_profile_renders_valid_slices() {
    for p in crate::sim::bundled_names() {
        let inv = crate::sim::load(p).unwrap();
        let slices = render(&inv, &book(&inv), DRIVER, NODE);
        assert!(!slices.is_empty(), "{p}");
        for s in &slices {
            if let Err(v) = validate(s) {
                panic!(
                    "{p}: {}: {v:#?}",
                    s.metadata.name.as_deref().unwrap_or_default()
                );
            }
            assert_eq!(s.spec.pool.resource_slice_count, slices.len() as i64);
            assert_eq!(s.spec.pool.name, NODE);
        }
        let names: Vec<String> = inv.dra_devices().iter().map(|d| d.dra_name()).collect();
        let rendered: Vec<String> = devices(&slices).iter().map(|d| d.name.clone()).collect();
        assert_eq!(
            rendered, names,
            "{p}: the inventory decides the devices and their order"
        );
        // Deterministic.
        assert_eq!(render(&inv, &book(&inv), DRIVER, NODE), slices, "{p}");
    }
    let inv = crate::sim::load("h100-mig-single").unwrap();
    let slices = render(&inv, &book(&inv), DRIVER, NODE);
    assert_eq!(devices(&slices).len(), 56);
    assert_eq!(slices.len(), 1);
}

#[test]
fn gpu_attributes_follow_nvidia() {
    let inv = crate::sim::load("dgx-h100").unwrap();
    let slices = render(&inv, &book(&inv), DRIVER, NODE);
    let all = devices(&slices);
    let d = all[0];
    assert_eq!(d.name, "gpu-0");
    assert_eq!(s(attr(d, "type")), "gpu");
    assert_eq!(s(attr(d, "uuid")), inv.gpus[0].uuid);
    assert_eq!(s(attr(d, "productName")), "NVIDIA H100 80GB HBM3");
    assert_eq!(s(attr(d, "brand")), "Nvidia");
    assert_eq!(s(attr(d, "architecture")), "Hopper");
    assert_eq!(
        attr(d, "cudaComputeCapability").version.as_deref(),
        Some("9.0.0")
    );
    assert_eq!(
        attr(d, "driverVersion").version.as_deref(),
        Some("550.90.7")
    );
    assert_eq!(
        attr(d, "cudaDriverVersion").version.as_deref(),
        Some("12.4.0")
    );
    assert_eq!(attr(d, "index").int, Some(0));
    assert_eq!(attr(d, "minor").int, Some(i64::from(inv.gpus[0].minor)));
    assert_eq!(attr(d, "resource.kubernetes.io/numaNode").int, Some(0));
    assert_eq!(
        s(attr(d, "resource.kubernetes.io/pciBusID")),
        "0000:18:00.0"
    );
    assert_eq!(s(attr(d, "resource.kubernetes.io/pcieRoot")), "pci0000:18");
    assert_eq!(d.capacity.as_ref().unwrap()["memory"].value.0, "81559Mi");
    assert!(d.taints.is_none());
    // GPUs 0 and 1 share a PCIe switch, so a root; 2 is behind another host bridge.
    assert_eq!(
        s(attr(all[1], "resource.kubernetes.io/pcieRoot")),
        "pci0000:18"
    );
    assert_eq!(
        s(attr(all[1], "resource.kubernetes.io/pciBusID")),
        "0000:2a:00.0"
    );
    assert_eq!(
        s(attr(all[2], "resource.kubernetes.io/pcieRoot")),
        "pci0000:3a"
    );
    assert_eq!(
        s(attr(all[7], "resource.kubernetes.io/numaNode")),
        "<not a string>"
    );
    assert_eq!(attr(all[7], "resource.kubernetes.io/numaNode").int, Some(1));
}

/// Under NVIDIA's driver name, only what NVIDIA's driver publishes is unqualified; gpuplane's
/// own `index`, `minor`, `parentIndex` live under `gpu.gpuplane.dev/`.
#[test]
fn under_nvidias_driver_name_our_own_attributes_keep_our_domain() {
    let inv = crate::sim::load("a100-mig-mixed").unwrap();
    let slices = render(&inv, &book(&inv), "gpu.nvidia.com", NODE);
    for d in devices(&slices) {
        let names: Vec<&str> = d
            .attributes
            .as_ref()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        for ours in ["index", "minor", "parentIndex"] {
            assert!(!names.contains(&ours), "{}: {names:?}", d.name);
        }
        let own = ["gpu.gpuplane.dev/index", "gpu.gpuplane.dev/parentIndex"];
        assert!(
            names.iter().any(|n| own.contains(n)),
            "{}: {names:?}",
            d.name
        );
        assert!(
            names
                .iter()
                .filter(|n| n.contains('/'))
                .all(|n| n.starts_with("gpu.gpuplane.dev/")
                    || n.starts_with("resource.kubernetes.io/")),
            "{names:?}"
        );
    }
}

#[test]
fn mig_attributes_follow_nvidia() {
    let inv = crate::sim::load("a100-mig-mixed").unwrap();
    let slices = render(&inv, &book(&inv), DRIVER, NODE);
    let all = devices(&slices);
    let d = all[0];
    let (gpu, mig) = (&inv.gpus[0], &inv.gpus[0].mig_devices[0]);
    assert_eq!(d.name, "gpu-0-mig-3g20gb-1");
    assert_eq!(s(attr(d, "type")), "mig");
    assert_eq!(s(attr(d, "uuid")), mig.uuid);
    assert_eq!(s(attr(d, "parentUUID")), gpu.uuid);
    assert_eq!(s(attr(d, "profile")), mig.profile);
    assert_eq!(attr(d, "parentIndex").int, Some(0));
    assert_eq!(s(attr(d, "productName")), gpu.product_name);
    assert_eq!(s(attr(d, "architecture")), "Ampere");
    assert_eq!(
        attr(d, "cudaComputeCapability").version.as_deref(),
        Some("8.0.0")
    );
    assert_eq!(
        s(attr(d, "resource.kubernetes.io/pciBusID")),
        "0000:01:00.0"
    );
    assert!(d
        .attributes
        .as_ref()
        .unwrap()
        .contains_key("resource.kubernetes.io/pcieRoot"));
    let cap = d.capacity.as_ref().unwrap();
    for k in [
        "multiprocessors",
        "copyEngines",
        "decoders",
        "encoders",
        "jpegEngines",
        "ofaEngines",
        "memory",
    ] {
        assert!(cap.contains_key(k), "{k}");
    }
    assert_eq!(
        cap["multiprocessors"].value.0,
        mig.multiprocessors.to_string()
    );
    assert_eq!(
        crate::quantity::Quantity::parse(&cap["memory"].value.0)
            .unwrap()
            .value(),
        Some(i64::try_from(mig.memory_mib << 20).unwrap())
    );
    // The whole GPU with MIG off is a plain GPU device.
    assert_eq!(s(attr(all.last().unwrap(), "type")), "gpu");
}

#[test]
fn more_than_128_devices_split_into_slices_of_one_generation() {
    let inv = synthetic("h100-mig-single", 3); // 24 GPUs x 7 = 168 MIG devices
    assert_eq!(inv.dra_devices().len(), 168);
    let slices = render_with_generation(&inv, &book(&inv), DRIVER, NODE, 7, &BTreeMap::new());
    assert_eq!(slices.len(), 3);
    for s in &slices {
        validate(s).unwrap();
        assert_eq!(s.spec.pool.generation, 7);
        assert_eq!(s.spec.pool.resource_slice_count, 3);
        let n = s.spec.devices.as_ref().unwrap().len();
        assert!(n <= DEVICES_PER_SLICE && n <= MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS);
        // Whole GPUs per slice: 63 = 9 GPUs.
        assert_eq!(n % 7, 0);
    }
    let names: Vec<&str> = slices
        .iter()
        .filter_map(|s| s.metadata.name.as_deref())
        .collect();
    assert_eq!(
        names,
        [
            "node-a-gpu-gpuplane-dev-0",
            "node-a-gpu-gpuplane-dev-1",
            "node-a-gpu-gpuplane-dev-2"
        ]
    );
    assert_eq!(devices(&slices).len(), 168);

    let whole = synthetic("dgx-h100", 17); // 136 whole GPUs
    let slices = render(&whole, &book(&whole), DRIVER, NODE);
    assert_eq!(
        slices
            .iter()
            .map(|s| s.spec.devices.as_ref().unwrap().len())
            .collect::<Vec<_>>(),
        [64, 64, 8]
    );
    slices.iter().for_each(|s| validate(s).unwrap());
}

#[test]
fn an_unhealthy_device_is_tainted_until_it_recovers() {
    let inv = crate::sim::load("a100-mig-mixed").unwrap();
    let mut health = book(&inv);
    let policy = crate::config::AgentConfig::default().xid_policy;
    let t0 = Instant::now();
    let gpu = &inv.gpus[0];
    health.on_event(
        &DeviceEvent::Xid {
            gpu_uuid: gpu.uuid.clone(),
            mig_uuid: Some(gpu.mig_devices[1].uuid.clone()),
            xid: 48,
        },
        t0,
        &policy,
    );
    let slices = render(&inv, &health, DRIVER, NODE);
    slices.iter().for_each(|s| validate(s).unwrap());
    let tainted: Vec<(&str, &DeviceTaint)> = devices(&slices)
        .into_iter()
        .flat_map(|d| d.taints.iter().flatten().map(move |t| (d.name.as_str(), t)))
        .collect();
    assert_eq!(tainted.len(), 1, "{tainted:?}");
    let (name, taint) = tainted[0];
    assert_eq!(
        *inv.dra_device(name).unwrap().uuid(),
        gpu.mig_devices[1].uuid
    );
    assert_eq!(taint.key, UNHEALTHY_TAINT_KEY);
    assert_eq!(taint.value.as_deref(), Some("xid-48"));
    assert_eq!(taint.effect, "NoSchedule");
    assert!(taint.time_added.is_none(), "the API server stamps it");

    // A lost GPU taints it (and would taint its MIG devices) with `lost`.
    health.on_lost(&inv.gpus[3].uuid, t0);
    let slices = render(&inv, &health, DRIVER, NODE);
    let gpu3 = devices(&slices)
        .into_iter()
        .find(|d| d.name == "gpu-3")
        .unwrap();
    assert_eq!(
        gpu3.taints.as_ref().unwrap()[0].value.as_deref(),
        Some("lost")
    );

    health.tick(
        t0 + Duration::from_secs(3600),
        Duration::from_secs(60),
        |_| true,
    );
    let slices = render(&inv, &health, DRIVER, NODE);
    assert!(devices(&slices).iter().all(|d| d.taints.is_none()));
    assert_eq!(slices, render(&inv, &book(&inv), DRIVER, NODE));
}

#[test]
fn a_hand_broken_slice_is_rejected_with_the_servers_paths() {
    let inv = crate::sim::load("dgx-h100").unwrap();
    let mut slice = render(&inv, &book(&inv), DRIVER, NODE).remove(0);
    let devs = slice.spec.devices.as_mut().unwrap();
    devs[0].name = "GPU_0".into();
    let attrs = devs[1].attributes.as_mut().unwrap();
    for i in 0..33 {
        attrs.insert(
            format!("extra{i}"),
            DeviceAttribute {
                int: Some(i),
                ..Default::default()
            },
        );
    }
    devs[2].attributes.as_mut().unwrap().insert(
        "productName".into(),
        DeviceAttribute {
            string: Some("x".repeat(65)),
            ..Default::default()
        },
    );
    devs[3].attributes.as_mut().unwrap().insert(
        "foo".into(),
        DeviceAttribute {
            int: Some(1),
            string: Some("one".into()),
            ..Default::default()
        },
    );
    devs[4].attributes.as_mut().unwrap().insert(
        "bad-name".into(),
        DeviceAttribute {
            bool: Some(true),
            ..Default::default()
        },
    );
    devs[5].attributes.as_mut().unwrap().insert(
        "v".into(),
        DeviceAttribute {
            version: Some("1.02.3".into()),
            ..Default::default()
        },
    );
    devs[6].taints = Some(vec![DeviceTaint {
        key: "k".into(),
        value: Some("v".into()),
        effect: "PreferNoSchedule".into(),
        time_added: None,
    }]);
    devs[7].name = devs[6].name.clone();
    slice.spec.pool.resource_slice_count = 0;
    slice.spec.all_nodes = Some(true);

    let v = validate(&slice).unwrap_err();
    let fields: Vec<&str> = v.iter().map(|v| v.field.as_str()).collect();
    for want in [
        "spec.pool.resourceSliceCount",
        "spec",
        "spec.devices[0].name",
        "spec.devices[1]",
        "spec.devices[2].attributes[productName].string",
        "spec.devices[3].attributes[foo]",
        "spec.devices[4].attributes[bad-name]",
        "spec.devices[5].attributes[v].version",
        "spec.devices[6].taints[0].effect",
        "spec.devices[7]",
    ] {
        assert!(fields.contains(&want), "{want} missing from {v:#?}");
    }
    let find = |f: &str| v.iter().find(|v| v.field == f).unwrap();
    assert!(
        matches!(find("spec.devices[1]").problem, Problem::Invalid { ref value, .. } if value == "47"),
        "{:?}",
        find("spec.devices[1]")
    );
    assert_eq!(
        find("spec.devices[2].attributes[productName].string").problem,
        Problem::TooLong { max: 64 }
    );
    assert!(find("spec.devices[3].attributes[foo]")
        .to_string()
        .contains("exactly one value must be specified"));
    assert_eq!(
        find("spec.devices[7]").problem,
        Problem::Duplicate("gpu-6".into())
    );
    assert_eq!(v.len(), fields.len());
    // Nothing else is wrong.
    assert_eq!(v.len(), 10, "{v:#?}");
}

#[test]
fn slice_level_rules() {
    let inv = crate::sim::load("pcie-l4x4").unwrap();
    let good = render(&inv, &book(&inv), DRIVER, NODE).remove(0);
    let check = |f: &dyn Fn(&mut ResourceSlice), want: &str| {
        let mut s = good.clone();
        f(&mut s);
        let v = validate(&s).unwrap_err();
        assert!(v.iter().any(|v| v.field == want), "{want}: {v:#?}");
    };
    check(&|s| s.spec.driver = "Not_A.Driver".into(), "spec.driver");
    check(
        &|s| s.spec.driver = format!("{}.example.com", "a".repeat(60)),
        "spec.driver",
    );
    check(&|s| s.spec.node_name = None, "spec");
    check(&|s| s.spec.pool.name = String::new(), "spec.pool.name");
    check(&|s| s.spec.pool.generation = -1, "spec.pool.generation");
    check(&|s| s.metadata.name = None, "metadata.name");
    check(
        &|s| {
            let d = s.spec.devices.as_mut().unwrap()[0].clone();
            s.spec.devices = Some(
                (0..129)
                    .map(|i| k8s_openapi::api::resource::v1::Device {
                        name: format!("d{i}"),
                        ..d.clone()
                    })
                    .collect(),
            );
        },
        "spec.devices",
    );
    check(
        &|s| {
            let mut d = s.spec.devices.as_mut().unwrap()[0].clone();
            d.taints = Some(vec![render::unhealthy_taint(crate::health::Cause::Lost)]);
            s.spec.devices = Some(
                (0..65)
                    .map(|i| k8s_openapi::api::resource::v1::Device {
                        name: format!("d{i}"),
                        ..d.clone()
                    })
                    .collect(),
            );
        },
        "spec.devices",
    );
    check(
        &|s| {
            s.spec.devices.as_mut().unwrap()[0]
                .attributes
                .as_mut()
                .unwrap()
                .insert(
                    "bad_domain/x".to_string(),
                    DeviceAttribute {
                        int: Some(1),
                        ..Default::default()
                    },
                )
                .map_or((), |_| ())
        },
        "spec.devices[0].attributes[bad_domain/x]",
    );
    check(
        &|s| {
            s.spec.devices.as_mut().unwrap()[0]
                .attributes
                .as_mut()
                .unwrap()
                .insert(
                    "a".repeat(33),
                    DeviceAttribute {
                        int: Some(1),
                        ..Default::default()
                    },
                )
                .map_or((), |_| ())
        },
        &format!("spec.devices[0].attributes[{}]", "a".repeat(33)),
    );
    check(
        &|s| {
            s.spec.devices.as_mut().unwrap()[0].taints = Some(vec![DeviceTaint {
                key: "bad key".into(),
                value: Some("-x".into()),
                effect: String::new(),
                time_added: None,
            }])
        },
        "spec.devices[0].taints[0].key",
    );
    check(
        &|s| {
            s.spec.devices.as_mut().unwrap()[0].taints = Some(vec![DeviceTaint {
                key: "k".into(),
                value: Some("-x".into()),
                effect: "NoExecute".into(),
                time_added: None,
            }])
        },
        "spec.devices[0].taints[0].value",
    );
    assert!(validate(&good).is_ok());
}

#[test]
fn helpers() {
    assert_eq!(semver("550.90.07").as_deref(), Some("550.90.7"));
    assert_eq!(semver("12.4").as_deref(), Some("12.4.0"));
    assert_eq!(semver("9").as_deref(), Some("9.0.0"));
    assert_eq!(semver("1.2.3.4"), None);
    assert_eq!(semver("abc"), None);
    assert!(validate::is_semver("1.2.3-rc.1+build.5"));
    assert!(!validate::is_semver("1.02.3"));
    assert!(!validate::is_semver("1.2"));
    assert_eq!(
        pci_address("00000000:AB:00.0").unwrap().to_string(),
        "0000:ab:00.0"
    );
    assert_eq!(
        pci_address("00010000:01:1f.7").unwrap().to_string(),
        "10000:01:1f.7"
    );
    assert!(pci_address("garbage").is_none());
    let inv = crate::sim::load("dgx1-v100").unwrap();
    assert_eq!(pcie_roots(&inv).len(), inv.gpus.len());

    let long = "n".repeat(250);
    let a = slice_name(&long, DRIVER, 0);
    let b = slice_name(&format!("{}m", "n".repeat(249)), DRIVER, 0);
    assert!(a.len() <= 253 && b.len() <= 253 && a != b, "{a} {b}");
    assert!(crate::names::is_dns_subdomain(&a));
    assert_eq!(slice_name(NODE, DRIVER, 3), "node-a-gpu-gpuplane-dev-3");
}

fn stored(mut slices: Vec<ResourceSlice>, generation: i64) -> Vec<ResourceSlice> {
    for (i, s) in slices.iter_mut().enumerate() {
        s.spec.pool.generation = generation;
        s.metadata.uid = Some(format!("uid-{i}"));
        s.metadata.resource_version = Some(format!("{}", 100 + i));
        for d in s.spec.devices.iter_mut().flatten() {
            for t in d.taints.iter_mut().flatten() {
                t.time_added = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    Default::default(),
                ));
            }
        }
    }
    slices
}

#[test]
fn plan_writes_only_differences_and_keeps_the_generation_when_it_can() {
    let inv = synthetic("h100-mig-single", 3);
    let health = book(&inv);
    let desired = render(&inv, &health, DRIVER, NODE);
    let echoes = Echoes::new();

    // Start-up: three creates at generation 1.
    let p = plan(&[], &desired, DRIVER, NODE, None, &echoes, 0);
    assert_eq!(
        (
            p.creates.len(),
            p.updates.len(),
            p.deletes.len(),
            p.generation
        ),
        (3, 0, 0, 1)
    );

    // Same content, whatever generation the renderer put: nothing to do.
    let existing = stored(desired.clone(), 4);
    assert!(plan(&existing, &desired, DRIVER, NODE, None, &echoes, 0).is_empty());

    // One slice changes (a GPU's MIG devices get a taint; server stamped timeAdded elsewhere).
    let mut sick = health.clone();
    let policy = crate::config::AgentConfig::default().xid_policy;
    sick.on_event(
        &DeviceEvent::Xid {
            gpu_uuid: inv.gpus[10].uuid.clone(),
            mig_uuid: None,
            xid: 48,
        },
        Instant::now(),
        &policy,
    );
    let changed = render(&inv, &sick, DRIVER, NODE);
    let p = plan(&existing, &changed, DRIVER, NODE, None, &echoes, 0);
    assert_eq!(
        (
            p.creates.len(),
            p.updates.len(),
            p.deletes.len(),
            p.generation
        ),
        (0, 1, 0, 4)
    );
    assert_eq!(
        p.updates[0].metadata.name.as_deref(),
        Some("node-a-gpu-gpuplane-dev-1")
    );
    assert_eq!(
        p.updates[0].metadata.resource_version.as_deref(),
        Some("101")
    );

    // Recovery with the taint stored: again exactly that slice.
    let existing_sick = stored(changed.clone(), 4);
    let p = plan(&existing_sick, &desired, DRIVER, NODE, None, &echoes, 0);
    assert_eq!((p.updates.len(), p.generation), (1, 4));
    // An unchanged taint keeps the server's timeAdded.
    let p = plan(&existing_sick, &changed, DRIVER, NODE, None, &echoes, 0);
    assert!(p.is_empty());

    // Two slices change: bump, rewrite all three.
    sick.on_event(
        &DeviceEvent::Xid {
            gpu_uuid: inv.gpus[0].uuid.clone(),
            mig_uuid: None,
            xid: 48,
        },
        Instant::now(),
        &policy,
    );
    let p = plan(
        &existing,
        &render(&inv, &sick, DRIVER, NODE),
        DRIVER,
        NODE,
        None,
        &echoes,
        0,
    );
    assert_eq!((p.updates.len(), p.generation), (3, 5));

    // Shrink from three slices to one: bump, update one, delete two.
    let small = crate::sim::load("h100-mig-single").unwrap();
    let one = render(&small, &book(&small), DRIVER, NODE);
    let p = plan(&existing, &one, DRIVER, NODE, None, &echoes, 0);
    assert_eq!(
        (
            p.creates.len(),
            p.updates.len(),
            p.deletes.len(),
            p.generation
        ),
        (0, 1, 2, 5)
    );
    assert_eq!(p.deletes[0].uid.as_deref(), Some("uid-1"));

    // Foreign pool with our name: deleted first, then created.
    let mut foreign = existing.clone();
    foreign[0].spec.pool.name = "other".into();
    let p = plan(&foreign, &desired, DRIVER, NODE, None, &echoes, 0);
    assert_eq!((p.delete_first.len(), p.creates.len()), (1, 1));

    // Empty desired: delete everything.
    let p = plan(&existing, &[], DRIVER, NODE, None, &echoes, 0);
    assert_eq!(p.deletes.len(), 3);
}

#[test]
fn plan_remembers_what_the_server_dropped() {
    let inv = crate::sim::load("a100-mig-mixed").unwrap();
    let mut health = book(&inv);
    health.on_lost(&inv.gpus[3].uuid, Instant::now());
    let desired = render(&inv, &health, DRIVER, NODE);
    // A server with DRADeviceTaints off drops the taint.
    let stripped = stored(render(&inv, &book(&inv), DRIVER, NODE), 1);
    assert_eq!(
        plan(&stripped, &desired, DRIVER, NODE, None, &Echoes::new(), 0)
            .updates
            .len(),
        1
    );
    let mut echoes = Echoes::new();
    echoes.insert(
        desired[0].metadata.name.clone().unwrap(),
        (
            plan::Content::of(&desired[0]),
            plan::Content::of(&stripped[0]),
        ),
    );
    assert!(plan(&stripped, &desired, DRIVER, NODE, None, &echoes, 0).is_empty());
}

#[test]
fn shared_units_are_published_with_consumable_memory_and_compute() {
    let inv = crate::sim::load("dgx-a100").unwrap();
    let cfg = crate::sharing::ShareConfig {
        select: crate::config::GpuSelect::Indices([1].into()),
        mig_devices: false,
        memory_step: 1 << 30,
        compute_step: 10,
        enforcement: crate::sharing::Enforcement::Mps,
    };
    let shared = crate::sharing::shared_units(&inv, Some(&cfg));
    assert_eq!(shared.len(), 1);
    let slices = render_with_generation(&inv, &book(&inv), DRIVER, NODE, 0, &shared);
    for s in &slices {
        validate(s).unwrap();
    }
    let devices: Vec<_> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect();
    let whole = devices.iter().find(|d| d.name == "gpu-0").unwrap();
    assert_eq!(whole.allow_multiple_allocations, None);
    let d = devices.iter().find(|d| d.name == "gpu-1").unwrap();
    assert_eq!(d.allow_multiple_allocations, Some(true));
    let caps = d.capacity.as_ref().unwrap();
    let json = serde_json::to_value(caps).unwrap();
    assert_eq!(
        json["memory"],
        serde_json::json!({"value": "80Gi", "requestPolicy": {"default": "80Gi",
            "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Gi"}}})
    );
    assert_eq!(
        json["compute"],
        serde_json::json!({"value": "100", "requestPolicy": {"default": "100",
            "validRange": {"min": "10", "max": "100", "step": "10"}}})
    );
}

#[test]
fn request_policies_are_checked_as_the_api_server_does() {
    let inv = crate::sim::load("dgx-h100").unwrap();
    let cfg = crate::sharing::ShareConfig::defaults();
    let shared = crate::sharing::shared_units(&inv, Some(&cfg));
    let mut slices = render_with_generation(&inv, &book(&inv), DRIVER, NODE, 0, &shared);
    // 81559Mi GPUs: max is the largest whole Gi below, and the slice is valid.
    validate(&slices[0]).unwrap();
    let device = &mut slices[0].spec.devices.as_mut().unwrap()[0];
    let memory = device.capacity.as_mut().unwrap().get_mut("memory").unwrap();
    let range = memory
        .request_policy
        .as_mut()
        .unwrap()
        .valid_range
        .as_mut()
        .unwrap();
    assert_eq!(range.max.as_ref().unwrap().0, "79Gi");
    range.max = Some(k8s_openapi::apimachinery::pkg::api::resource::Quantity(
        "81559Mi".into(),
    ));
    let errors = validate(&slices[0]).unwrap_err();
    let text = format!("{errors:?}");
    assert!(
        text.contains("capacity[memory].requestPolicy.validRange.step")
            && text.contains("not a multiple of a given step"),
        "{text}"
    );
}

#[test]
fn shared_mig_devices_offer_their_own_memory_and_compute_only() {
    let inv = crate::sim::load("a100-mig-mixed").unwrap();
    let cfg = crate::sharing::ShareConfig {
        mig_devices: true,
        ..crate::sharing::ShareConfig::defaults()
    };
    let shared = crate::sharing::shared_units(&inv, Some(&cfg));
    let slices = render_with_generation(&inv, &book(&inv), DRIVER, NODE, 0, &shared);
    slices.iter().for_each(|s| validate(s).unwrap());
    let mig = inv.gpus[0]
        .mig_devices
        .iter()
        .find(|m| m.memory_mib >= 2048)
        .unwrap();
    let device = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| {
            d.attributes.as_ref().unwrap()["uuid"].string.as_deref() == Some(mig.uuid.as_str())
        })
        .unwrap();
    assert_eq!(device.allow_multiple_allocations, Some(true));
    let caps: Vec<&String> = device.capacity.as_ref().unwrap().keys().collect();
    assert_eq!(
        caps,
        ["compute", "memory"],
        "engine counts would be consumed whole by each share"
    );
    // Without migDevices, MIG devices stay whole.
    let whole = crate::sharing::shared_units(&inv, Some(&crate::sharing::ShareConfig::defaults()));
    assert!(!whole.contains_key(&mig.uuid));
}
