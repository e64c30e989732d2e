use super::*;
use crate::inventory::mig::{self, PlacedInstance};
use std::collections::BTreeSet;

/// An H100 node whose GPUs are dynamic, with `table` swapped in (the table is what matters).
fn node(table: &str) -> Inventory {
    let mut inv = crate::sim::load("dgx-h100").unwrap();
    for g in &mut inv.gpus {
        g.mig.current = true;
        g.mig.pending = true;
        g.mig.table = Some(table.to_string());
        g.mig.dynamic = true;
    }
    inv
}

fn instance(d: &DynamicDevice<'_>) -> PlacedInstance {
    match d.slot {
        Slot::Instance { profile, start } => PlacedInstance { profile, start },
        Slot::Whole => panic!("not an instance"),
    }
}

/// Every set of `devs` (as bit masks) whose summed consumption fits `counters`.
fn counter_family(devs: &[DynamicDevice<'_>], counters: &BTreeMap<String, u32>) -> BTreeSet<u64> {
    fn walk(
        i: usize,
        mask: u64,
        used: &mut BTreeMap<String, u32>,
        devs: &[BTreeMap<String, u32>],
        counters: &BTreeMap<String, u32>,
        out: &mut BTreeSet<u64>,
    ) {
        if i == devs.len() {
            out.insert(mask);
            return;
        }
        walk(i + 1, mask, used, devs, counters, out);
        let fits = devs[i].iter().all(|(k, v)| {
            counters
                .get(k)
                .is_some_and(|cap| used.get(k).copied().unwrap_or(0) + v <= *cap)
        });
        if fits {
            for (k, v) in &devs[i] {
                *used.entry(k.clone()).or_insert(0) += v;
            }
            walk(i + 1, mask | 1 << i, used, devs, counters, out);
            for (k, v) in &devs[i] {
                *used.entry(k.clone()).or_insert(0) -= v;
            }
        }
    }
    let consumes: Vec<BTreeMap<String, u32>> = devs.iter().map(DynamicDevice::consumes).collect();
    let mut out = BTreeSet::new();
    walk(0, 0, &mut BTreeMap::new(), &consumes, counters, &mut out);
    out
}

fn placed(devs: &[DynamicDevice<'_>], mask: u64) -> Vec<PlacedInstance> {
    (0..devs.len())
        .filter(|i| mask & 1 << i != 0)
        .map(|i| instance(&devs[i]))
        .collect()
}

/// Every set the hardware reaches by creating instances one at a time, in any order.
fn admit_family(table: &MigCatalogue, devs: &[DynamicDevice<'_>]) -> BTreeSet<u64> {
    let mut seen = BTreeSet::from([0u64]);
    let mut frontier = vec![0u64];
    while let Some(mask) = frontier.pop() {
        let now = placed(devs, mask);
        for (j, d) in devs.iter().enumerate() {
            let next = mask | 1 << j;
            if next == mask || seen.contains(&next) {
                continue;
            }
            let i = instance(d);
            if table.admit(&now, i.profile, i.start).is_ok() {
                seen.insert(next);
                frontier.push(next);
            }
        }
    }
    seen
}

#[test]
fn counters_allow_exactly_the_instance_sets_the_hardware_admits() {
    for name in mig::catalogue_names() {
        let inv = node(name);
        let g = &inv.gpus[0];
        let table = mig::catalogue(name).unwrap();
        let all = gpu_devices(g, table);
        let (whole, instances) = all.split_first().unwrap();
        assert_eq!(whole.slot, Slot::Whole);
        assert!(instances.len() < 64, "{name}: masks are u64");
        let counters = counters(table);
        let by_counters = counter_family(instances, &counters);
        let by_admit = admit_family(table, instances);
        assert_eq!(by_counters, by_admit, "{name}");
        // Not trivially equal: many sets, and not every set.
        assert!(by_admit.len() > instances.len() * 4, "{name}");
        assert!(
            !by_admit.contains(&((1u64 << instances.len()) - 1)),
            "{name}"
        );
        // Any order: each set is also admitted highest device first.
        for &mask in &by_admit {
            let mut now = Vec::new();
            for j in (0..instances.len()).rev().filter(|j| mask & 1 << j != 0) {
                let i = instance(&instances[j]);
                assert_eq!(table.admit(&now, i.profile, i.start), Ok(()), "{name}");
                now.push(i);
            }
        }
        // The whole GPU fits alone and excludes every instance.
        assert_eq!(
            counter_family(std::slice::from_ref(whole), &counters).len(),
            2
        );
        for d in instances {
            let pair = [*whole, *d];
            assert_eq!(
                counter_family(&pair, &counters),
                BTreeSet::from([0, 1, 2]),
                "{name}: the whole GPU and {}",
                d.dra_name()
            );
        }
    }
}

#[test]
fn the_h100s_table_gives_26_devices_and_13_counters() {
    let inv = node("h100-80gb");
    assert_eq!(devices(&inv).len(), 8 * 26);
    let table = mig::catalogue("h100-80gb").unwrap();
    let c = counters(table);
    assert_eq!(c.len(), 8 + 1 + 4, "{c:?}");
    assert_eq!(c["compute-slices"], 7);
    assert_eq!(c["copy-engines"], 8);
    assert_eq!(c["ofa-engines"], 1);
    assert!(!c.contains_key("encoders"), "the H100 has no NVENC");
    let d = device(&inv, "gpu-3-mig-3g40gb-at4").unwrap();
    assert_eq!(d.parent.index, 3);
    assert_eq!(
        d.consumes(),
        BTreeMap::from([
            ("memory-slice-4".to_string(), 1),
            ("memory-slice-5".to_string(), 1),
            ("memory-slice-6".to_string(), 1),
            ("memory-slice-7".to_string(), 1),
            ("compute-slices".to_string(), 3),
            ("copy-engines".to_string(), 3),
            ("decoders".to_string(), 3),
            ("jpeg-engines".to_string(), 3),
        ])
    );
    assert_eq!(device(&inv, "gpu-3").unwrap().consumes(), c);
    assert_eq!(counter_set_name(d.parent), "gpu-3");
}

fn is_label(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 63
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !n.starts_with('-')
        && !n.ends_with('-')
}

#[test]
fn names_are_labels_parse_back_and_never_look_static() {
    for name in mig::catalogue_names() {
        let mut inv = node(name);
        inv.gpus[7].index = 123;
        let all = devices(&inv);
        let names: Vec<String> = all.iter().map(DynamicDevice::dra_name).collect();
        assert_eq!(
            names.iter().collect::<BTreeSet<_>>().len(),
            names.len(),
            "{name}"
        );
        for (d, n) in all.iter().zip(&names) {
            assert!(is_label(n), "{n}");
            assert_eq!(device(&inv, n), Some(*d), "{n}");
            // Static MIG names end in `-<gi>[-<ci>]`, digits only.
            assert!(n
                .rsplit('-')
                .next()
                .is_some_and(|last| last.starts_with("at") || d.slot == Slot::Whole));
        }
        for c in counters(mig::catalogue(name).unwrap()).keys() {
            assert!(is_label(c), "{c}");
        }
    }
    let inv = node("a100-40gb");
    assert_eq!(
        device(&inv, "gpu-0-mig-1g5gbme-at6").map(|d| d.to_request()),
        Some(MigRequest {
            gpu: inv.gpus[0].uuid.clone(),
            profile: "1g.5gb+me".into(),
            start: 6,
        })
    );
    for bad in [
        "gpu-0-mig-1g5gb-at7",  // not an allowed start
        "gpu-0-mig-3g20gb-at2", // not an allowed start
        "gpu-01",               // not canonical
        "gpu-0-mig-1g5gb-1",    // a static MIG device's form
        "gpu-8",                // no such GPU
        "gpu-0-mig-9g5gb-at0",  // no such profile
        "gpu-",
        "gpu-0-mig-1g5gb-at",
    ] {
        assert_eq!(device(&inv, bad), None, "{bad}");
    }
    let mut not_dynamic = inv.clone();
    not_dynamic.gpus[0].mig.dynamic = false;
    assert_eq!(device(&not_dynamic, "gpu-0"), None);
    assert!(device(&not_dynamic, "gpu-1").is_some());
}

#[test]
fn the_whole_gpu_asks_for_the_full_profile_at_zero() {
    for name in mig::catalogue_names() {
        let inv = node(name);
        let whole = device(&inv, "gpu-0").unwrap();
        let table = mig::catalogue(name).unwrap();
        let full = table.full_profile().unwrap();
        assert_eq!(
            whole.to_request(),
            MigRequest {
                gpu: inv.gpus[0].uuid.clone(),
                profile: full.name.to_string(),
                start: 0,
            }
        );
        assert_eq!(whole.profile(), Some(full));
        assert_eq!(
            whole.placement(),
            Placement {
                start: 0,
                size: table.memory_slices
            }
        );
        // The full-profile instance consumes what the whole GPU does.
        let full_instance = DynamicDevice {
            slot: Slot::Instance {
                profile: full,
                start: 0,
            },
            ..whole
        };
        assert_eq!(full_instance.consumes(), whole.consumes(), "{name}");
    }
}
