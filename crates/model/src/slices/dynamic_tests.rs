//! Slices of dynamic-MIG GPUs: rendering, and the counter rules of the validator.

use super::tests::{attr, book, devices, s, synthetic, DRIVER, NODE};
use super::*;
use crate::config::GpuSelect;
use crate::dynamic_mig::{self, DynamicMigConfig};
use crate::health::HealthBook;
use crate::inventory::Inventory;
use crate::source::DeviceEvent;
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceCounterConsumption, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;
use std::collections::BTreeMap;
use std::time::Instant;

/// Makes the GPUs `which` of `inv` dynamic the way the agent does: MIG on, the product's
/// table, no instances, then `plan` and `mark`.
fn make_dynamic(inv: &mut Inventory, which: &[u32]) {
    for g in inv.gpus.iter_mut().filter(|g| which.contains(&g.index)) {
        g.mig.current = true;
        g.mig.pending = true;
        g.mig.capable = true;
        g.mig.table = crate::inventory::mig::catalogue_for_product(&g.product_name)
            .map(|t| t.name.to_string());
        g.mig_devices.clear();
    }
    let cfg = DynamicMigConfig {
        select: GpuSelect::Indices(which.iter().copied().collect()),
    };
    let p = dynamic_mig::plan(inv, &cfg, &|_, _| false);
    assert_eq!(p.gpus.len(), which.len(), "{p:?}");
    dynamic_mig::mark(inv, &p);
}

/// GPU 0 dynamic, GPU 1 and 2 static MIG, GPU 3 whole: the three ways a GPU is published.
fn mixed() -> Inventory {
    let mut inv = crate::sim::load("a100-mig-mixed").unwrap();
    make_dynamic(&mut inv, &[0]);
    inv
}

fn valid(slices: &[ResourceSlice]) {
    for s in slices {
        if let Err(v) = validate(s) {
            panic!("{:?}: {v:#?}", s.metadata.name);
        }
    }
    if let Err(v) = validate_pool(slices) {
        panic!("{v:#?}");
    }
}

fn counters_of(d: &Device) -> &BTreeMap<String, Counter> {
    let cc = d.consumes_counters.as_ref().unwrap();
    assert_eq!(cc.len(), 1, "{}", d.name);
    assert_eq!(cc[0].counter_set, "gpu-0");
    &cc[0].counters
}

fn int(d: &Device, name: &str) -> i64 {
    attr(d, name).int.unwrap()
}

fn capacity(d: &Device, name: &str) -> String {
    d.capacity.as_ref().unwrap()[name].value.0.clone()
}

#[test]
fn a_mixed_node_publishes_each_gpu_its_way() {
    let inv = mixed();
    let slices = render_with_generation(&inv, &book(&inv), DRIVER, NODE, 3, &BTreeMap::new());
    valid(&slices);
    for s in &slices {
        assert_eq!(s.spec.pool.generation, 3);
        assert_eq!(s.spec.pool.resource_slice_count, slices.len() as i64);
    }
    // The devices, then one slice with GPU 0's counter set.
    let (last, device_slices) = slices.split_last().unwrap();
    assert_eq!(last.spec.devices, None);
    let sets = last.spec.shared_counters.as_ref().unwrap();
    assert_eq!(sets.len(), 1);
    assert_eq!(sets[0].name, "gpu-0");
    let table = crate::inventory::mig::catalogue("a100-40gb").unwrap();
    let want: BTreeMap<String, String> = dynamic_mig::counters(table)
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect();
    let got: BTreeMap<String, String> = sets[0]
        .counters
        .iter()
        .map(|(k, c)| (k.clone(), c.value.0.clone()))
        .collect();
    assert_eq!(got, want);
    assert_eq!(got["compute-slices"], "7");
    assert_eq!(got["decoders"], "5");
    assert_eq!(got.len(), 8 + 1 + 4, "{got:?}");
    assert!(device_slices
        .iter()
        .all(|s| s.spec.shared_counters.is_none()));

    // GPU 0: the whole GPU and its 25 instances, in one slice, all consuming its counters.
    let names: Vec<String> = devices(&slices).iter().map(|d| d.name.clone()).collect();
    let dynamic: Vec<String> = dynamic_mig::devices(&inv)
        .iter()
        .map(|d| d.dra_name())
        .collect();
    let statics: Vec<String> = inv.dra_devices().iter().map(|d| d.dra_name()).collect();
    assert_eq!(dynamic.len(), 26);
    assert_eq!(names, [dynamic.clone(), statics.clone()].concat());
    assert!(statics.contains(&"gpu-3".to_string()));
    assert!(statics.iter().any(|n| n.starts_with("gpu-1-mig-")));
    let holding = |n: &str| {
        device_slices
            .iter()
            .position(|s| s.spec.devices.iter().flatten().any(|d| d.name == n))
    };
    assert!(dynamic.iter().all(|n| holding(n) == holding("gpu-0")));
    for d in devices(&slices) {
        let is_dynamic = dynamic.contains(&d.name);
        assert_eq!(d.consumes_counters.is_some(), is_dynamic, "{}", d.name);
    }
}

#[test]
fn dynamic_devices_carry_mig_attributes_without_a_uuid() {
    let inv = mixed();
    let slices = render(&inv, &book(&inv), DRIVER, NODE);
    let all = devices(&slices);
    let find = |n: &str| *all.iter().find(|d| d.name == n).unwrap();
    let gpu = &inv.gpus[0];

    let d = find("gpu-0-mig-3g20gb-at4");
    assert_eq!(s(attr(d, "type")), "mig");
    assert_eq!(s(attr(d, "profile")), "3g.20gb");
    assert_eq!(s(attr(d, "parentUUID")), gpu.uuid);
    assert_eq!(int(d, "parentIndex"), 0);
    assert_eq!(int(d, "placementStart"), 4);
    assert_eq!(int(d, "placementSize"), 4);
    assert_eq!(s(attr(d, "productName")), "NVIDIA A100-SXM4-40GB");
    assert_eq!(s(attr(d, "cudaComputeCapability")), "8.0.0");
    assert_eq!(s(attr(d, "driverVersion")), "535.183.1");
    assert_eq!(
        s(attr(d, "resource.kubernetes.io/pciBusID")),
        "0000:01:00.0"
    );
    assert!(d
        .attributes
        .as_ref()
        .unwrap()
        .contains_key("resource.kubernetes.io/pcieRoot"));
    assert_eq!(int(d, "resource.kubernetes.io/numaNode"), 0);
    assert!(!d.attributes.as_ref().unwrap().contains_key("uuid"));
    assert_eq!(capacity(d, "memory"), "20096Mi");
    assert_eq!(capacity(d, "multiprocessors"), "42");
    assert_eq!(capacity(d, "decoders"), "2");
    let c = counters_of(d);
    let mut keys: Vec<&str> = c.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "compute-slices",
            "copy-engines",
            "decoders",
            "memory-slice-4",
            "memory-slice-5",
            "memory-slice-6",
            "memory-slice-7"
        ]
    );
    assert_eq!(c["compute-slices"].value.0, "3");

    let me = find("gpu-0-mig-1g5gbme-at6");
    assert_eq!(s(attr(me, "profile")), "1g.5gb+me");
    assert_eq!(counters_of(me)["ofa-engines"].value.0, "1");
    assert!(!counters_of(find("gpu-0-mig-1g5gb-at6")).contains_key("ofa-engines"));

    // The whole GPU: a GPU as without MIG, consuming every counter.
    let whole = find("gpu-0");
    assert_eq!(s(attr(whole, "type")), "gpu");
    assert_eq!(s(attr(whole, "uuid")), gpu.uuid);
    assert_eq!(int(whole, "index"), 0);
    assert_eq!(capacity(whole, "memory"), "40Gi");
    let last = slices.last().unwrap();
    assert_eq!(
        counters_of(whole),
        &last.spec.shared_counters.as_ref().unwrap()[0].counters
    );
}

#[test]
fn under_nvidias_driver_name_placement_keeps_our_domain() {
    let inv = mixed();
    let slices = render(&inv, &book(&inv), "gpu.nvidia.com", NODE);
    valid(&slices);
    let all = devices(&slices);
    let d = all
        .iter()
        .find(|d| d.name == "gpu-0-mig-7g40gb-at0")
        .unwrap();
    assert_eq!(int(d, "gpu.gpuplane.dev/placementStart"), 0);
    assert_eq!(int(d, "gpu.gpuplane.dev/placementSize"), 8);
    assert_eq!(int(d, "gpu.gpuplane.dev/parentIndex"), 0);
    assert!(!d
        .attributes
        .as_ref()
        .unwrap()
        .contains_key("placementStart"));
}

#[test]
fn an_unhealthy_gpu_taints_every_dynamic_device() {
    let inv = mixed();
    let mut health = HealthBook::default();
    health.set_inventory(&inv);
    let policy = crate::config::AgentConfig::default().xid_policy;
    health.on_event(
        &DeviceEvent::Xid {
            gpu_uuid: inv.gpus[0].uuid.clone(),
            mig_uuid: None,
            xid: 48,
        },
        Instant::now(),
        &policy,
    );
    let slices = render(&inv, &health, DRIVER, NODE);
    valid(&slices);
    for d in devices(&slices) {
        let tainted = d.taints.as_ref().is_some_and(|t| {
            t.len() == 1
                && t[0].key == UNHEALTHY_TAINT_KEY
                && t[0].value.as_deref() == Some("xid-48")
        });
        assert_eq!(tainted, d.name.starts_with("gpu-0"), "{}", d.name);
    }
    // The taint does not move a device: same slices, same names.
    let healthy = render(&inv, &book(&inv), DRIVER, NODE);
    assert_eq!(healthy.len(), slices.len());
    for (a, b) in healthy.iter().zip(&slices) {
        assert_eq!(a.metadata.name, b.metadata.name);
        let names = |s: &ResourceSlice| -> Vec<String> {
            s.spec
                .devices
                .iter()
                .flatten()
                .map(|d| d.name.clone())
                .collect()
        };
        assert_eq!(names(a), names(b));
    }
}

#[test]
fn many_dynamic_gpus_split_devices_by_gpu_and_counter_sets_by_eight() {
    let mut inv = synthetic("dgx-h100", 2);
    let all: Vec<u32> = inv.gpus.iter().map(|g| g.index).collect();
    make_dynamic(&mut inv, &all);
    let slices = render(&inv, &book(&inv), DRIVER, NODE);
    valid(&slices);
    let (counter_slices, device_slices): (Vec<&ResourceSlice>, Vec<&ResourceSlice>) = slices
        .iter()
        .partition(|s| s.spec.shared_counters.is_some());
    // 26 devices per H100: two GPUs to a slice of at most 64.
    assert_eq!(device_slices.len(), 8);
    for s in &device_slices {
        assert_eq!(s.spec.devices.as_ref().unwrap().len(), 52);
    }
    let sets: Vec<usize> = counter_slices
        .iter()
        .map(|s| s.spec.shared_counters.as_ref().unwrap().len())
        .collect();
    assert_eq!(sets, [8, 8]);
    assert_eq!(devices(&slices).len(), 16 * 26);
}

/// A device consuming `counters` of set `set`.
fn consumer(name: &str, set: &str, counters: &[(&str, &str)]) -> Device {
    Device {
        name: name.into(),
        consumes_counters: Some(vec![DeviceCounterConsumption {
            counter_set: set.into(),
            counters: counters
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        Counter {
                            value: ApiQuantity(v.to_string()),
                        },
                    )
                })
                .collect(),
        }]),
        ..Device::default()
    }
}

fn set(name: &str, counters: &[(&str, &str)]) -> CounterSet {
    CounterSet {
        name: name.into(),
        counters: counters
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    Counter {
                        value: ApiQuantity(v.to_string()),
                    },
                )
            })
            .collect(),
    }
}

#[test]
fn the_pool_checks_what_the_scheduler_checks() {
    let inv = mixed();
    let good = render(&inv, &book(&inv), DRIVER, NODE);
    let with = |f: &dyn Fn(&mut Vec<ResourceSlice>)| {
        let mut s = good.clone();
        f(&mut s);
        validate_pool(&s).unwrap_err()
    };
    let fields = |v: &[Violation]| v.iter().map(|v| v.field.clone()).collect::<Vec<_>>();

    // No counter slice: every consumer names a missing set.
    let v = with(&|s| {
        s.pop();
        for x in s.iter_mut() {
            x.spec.pool.resource_slice_count -= 1;
        }
    });
    assert_eq!(v.len(), 26, "{v:#?}");
    assert!(v[0]
        .field
        .ends_with("/spec.devices[0].consumesCounters[0].counterSet"));
    assert!(
        v[0].to_string().contains("no counter set of this name"),
        "{}",
        v[0]
    );

    let name0 = good[0].metadata.name.clone().unwrap();
    // A counter the set lacks, and one too small for the whole GPU.
    let v = with(&|s| {
        counters(s).remove("ofa-engines");
    });
    assert!(
        v.iter()
            .all(|v| v.field.ends_with(".counters[ofa-engines]")),
        "{v:#?}"
    );
    assert_eq!(
        v.len(),
        9,
        "the whole GPU, seven 1g.5gb+me and 7g.40gb: {v:#?}"
    );
    let v = with(&|s| {
        counters(s).insert(
            "decoders".into(),
            Counter {
                value: ApiQuantity("4".into()),
            },
        );
    });
    // The whole GPU and 7g.40gb, first and last of GPU 0's devices, need five.
    assert_eq!(
        fields(&v),
        [0, 25]
            .map(|i| format!("{name0}/spec.devices[{i}].consumesCounters[0].counters[decoders]"))
    );
    assert!(
        v[0].to_string().contains("could never be allocated"),
        "{}",
        v[0]
    );

    // The same set twice, the same device twice, a wrong count.
    let v = with(&|s| {
        let mut again = s.last().unwrap().clone();
        again.metadata = named("again");
        s.push(again);
    });
    assert!(
        v.iter()
            .any(|v| v.problem == Problem::Duplicate("gpu-0".into())),
        "{v:#?}"
    );
    assert!(
        v.iter()
            .any(|v| v.field.ends_with("spec.pool.resourceSliceCount")),
        "{v:#?}"
    );
    let v = with(&|s| {
        let mut extra = s[0].clone();
        extra.metadata = named("extra");
        extra.spec.devices = Some(vec![s[0].spec.devices.as_ref().unwrap()[1].clone()]);
        s.push(extra);
        let n = s.len() as i64;
        for x in s.iter_mut() {
            x.spec.pool.resource_slice_count = n;
        }
    });
    assert_eq!(fields(&v), ["extra/spec.devices[0].name"]);
    assert!(
        matches!(&v[0].problem, Problem::Duplicate(n) if n == "gpu-0-mig-1g5gb-at0"),
        "{v:#?}"
    );

    // Pools are told apart by driver, pool and generation: a good pool stays good beside a
    // newer generation that lacks its counter slice.
    let mut newer = good.clone();
    newer.pop();
    for s in &mut newer {
        s.spec.pool.generation = 9;
        s.spec.pool.resource_slice_count -= 1;
    }
    let v = validate_pool(&[good.clone(), newer].concat()).unwrap_err();
    assert_eq!(v.len(), 26, "{v:#?}");
    let mut renamed = good.clone();
    for s in &mut renamed {
        s.spec.pool.name = "node-b".into();
    }
    assert_eq!(validate_pool(&[good.clone(), renamed].concat()), Ok(()));
    let lone = vec![ResourceSlice {
        spec: ResourceSliceSpec {
            devices: Some(vec![consumer("d", "s", &[("c", "1")])]),
            shared_counters: None,
            ..good[0].spec.clone()
        },
        ..good[0].clone()
    }];
    assert_eq!(
        validate_pool(&lone).unwrap_err().len(),
        2,
        "missing set, and the count"
    );
}

fn counters(s: &mut [ResourceSlice]) -> &mut BTreeMap<String, Counter> {
    let last = s.last_mut().unwrap();
    &mut last.spec.shared_counters.as_mut().unwrap()[0].counters
}

/// Metadata with just a name.
fn named(n: &str) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
    k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        name: Some(n.into()),
        ..Default::default()
    }
}

#[test]
fn a_slice_checks_counters_as_the_api_server_does() {
    let inv = mixed();
    let good = render(&inv, &book(&inv), DRIVER, NODE);
    let counter_slice = good.last().unwrap().clone();
    let device_slice = good[0].clone();
    let check = |base: &ResourceSlice, f: &dyn Fn(&mut ResourceSlice), want: &str| {
        let mut s = base.clone();
        f(&mut s);
        let v = validate(&s).unwrap_err();
        assert!(v.iter().any(|v| v.field == want), "{want}: {v:#?}");
        v
    };
    // Counters and devices in one slice.
    check(
        &counter_slice,
        &|s| s.spec.devices = Some(Vec::new()),
        "spec",
    );
    // Nine sets.
    let v = check(
        &counter_slice,
        &|s| {
            s.spec.shared_counters = Some(
                (0..9)
                    .map(|i| set(&format!("gpu-{i}"), &[("c", "1")]))
                    .collect(),
            )
        },
        "spec.sharedCounters",
    );
    assert_eq!(v[0].problem, Problem::TooMany { count: 9, max: 8 });
    // 33 counters in a set; a bad counter name; a bad set name; a duplicate set; none.
    let many: Vec<(String, &str)> = (0..33).map(|i| (format!("c{i}"), "1")).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    check(
        &counter_slice,
        &|s| s.spec.shared_counters = Some(vec![set("a", &many)]),
        "spec.sharedCounters[0].counters",
    );
    check(
        &counter_slice,
        &|s| s.spec.shared_counters = Some(vec![set("a", &[("Memory_0", "1")])]),
        "spec.sharedCounters[0].counters[Memory_0]",
    );
    check(
        &counter_slice,
        &|s| s.spec.shared_counters = Some(vec![set("GPU.0", &[("c", "1")])]),
        "spec.sharedCounters[0].name",
    );
    check(
        &counter_slice,
        &|s| s.spec.shared_counters = Some(vec![set("a", &[("c", "1")]), set("a", &[("c", "1")])]),
        "spec.sharedCounters[1]",
    );
    check(
        &counter_slice,
        &|s| s.spec.shared_counters = Some(vec![set("a", &[])]),
        "spec.sharedCounters[0].counters",
    );
    // A device with three consumptions, one with 33 counters, one with a bad counter name.
    check(
        &device_slice,
        &|s| {
            let d = &mut s.spec.devices.as_mut().unwrap()[0];
            let one = consumer("x", "a", &[("c", "1")])
                .consumes_counters
                .unwrap()
                .remove(0);
            d.consumes_counters = Some(vec![
                DeviceCounterConsumption {
                    counter_set: "a".into(),
                    ..one.clone()
                },
                DeviceCounterConsumption {
                    counter_set: "b".into(),
                    ..one.clone()
                },
                DeviceCounterConsumption {
                    counter_set: "c".into(),
                    ..one
                },
            ]);
        },
        "spec.devices[0].consumesCounters",
    );
    check(
        &device_slice,
        &|s| s.spec.devices.as_mut().unwrap()[1] = consumer("d", "gpu-0", &many),
        "spec.devices[1].consumesCounters[0].counters",
    );
    check(
        &device_slice,
        &|s| s.spec.devices.as_mut().unwrap()[1] = consumer("d", "gpu-0", &[("Bad", "1")]),
        "spec.devices[1].consumesCounters[0].counters[Bad]",
    );
    // 65 devices that consume counters.
    check(
        &device_slice,
        &|s| {
            let d = s.spec.devices.as_ref().unwrap()[1].clone();
            s.spec.devices = Some(
                (0..65)
                    .map(|i| Device {
                        name: format!("d{i}"),
                        ..d.clone()
                    })
                    .collect(),
            );
        },
        "spec.devices",
    );
    // Two consumptions are allowed.
    let mut two = device_slice.clone();
    let d = &mut two.spec.devices.as_mut().unwrap()[1];
    let mut cc = d.consumes_counters.clone().unwrap();
    cc.push(DeviceCounterConsumption {
        counter_set: "other".into(),
        ..cc[0].clone()
    });
    d.consumes_counters = Some(cc);
    assert_eq!(validate(&two), Ok(()));
}

#[test]
fn every_mig_capable_bundled_gpu_renders_valid_dynamic_slices() {
    for p in crate::sim::bundled_names() {
        let mut inv = crate::sim::load(p).unwrap();
        let capable: Vec<u32> = inv
            .gpus
            .iter()
            .filter(|g| crate::inventory::mig::catalogue_for_product(&g.product_name).is_some())
            .map(|g| g.index)
            .collect();
        if capable.is_empty() {
            continue;
        }
        make_dynamic(&mut inv, &capable);
        let slices = render(&inv, &book(&inv), DRIVER, NODE);
        valid(&slices);
        assert_eq!(
            slices
                .iter()
                .filter(|s| s.spec.shared_counters.is_some())
                .count(),
            capable.len().div_ceil(MAX_COUNTER_SETS_PER_SLICE),
            "{p}"
        );
    }
}
