//! The rules only a whole pool shows: what the scheduler checks when it reads a pool's slices
//! of one generation (`k8s.io/dynamic-resource-allocation/structured/internal/stable/
//! pools_stable.go`: `getAndValidateCounterSets`, `validateDeviceNames`,
//! `validateDeviceCounterConsumption`; a pool failing them is invalid and nothing in it is
//! allocated), plus two of gpuplane's own: the slice count matches, and no device consumes
//! more of a counter than its set has (such a device could never be allocated).

use super::{invalid, Problem, Violation};
use crate::quantity::Quantity;
use k8s_openapi::api::resource::v1::{Counter, ResourceSlice};
use std::collections::{BTreeMap, BTreeSet};

/// Checks the slices of each pool, per (driver, pool, generation), as one. Use it beside
/// [`super::validate`] on each slice; it repeats none of the per-slice rules. Fields are
/// `<slice name>/<path in that slice>`.
pub fn validate_pool(slices: &[ResourceSlice]) -> Result<(), Vec<Violation>> {
    let mut pools: BTreeMap<(&str, &str, i64), Vec<&ResourceSlice>> = BTreeMap::new();
    for s in slices {
        let p = &s.spec.pool;
        pools
            .entry((s.spec.driver.as_str(), p.name.as_str(), p.generation))
            .or_default()
            .push(s);
    }
    let mut out = Vec::new();
    for pool in pools.values() {
        check_pool(pool, &mut out);
    }
    if out.is_empty() {
        Ok(())
    } else {
        Err(out)
    }
}

fn field(slice: &ResourceSlice, path: &str) -> String {
    format!(
        "{}/{path}",
        slice.metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

fn check_pool(pool: &[&ResourceSlice], out: &mut Vec<Violation>) {
    let mut push = |field: String, problem: Problem| out.push(Violation { field, problem });
    let mut sets: Sets<'_> = BTreeMap::new();
    let mut devices: BTreeSet<&str> = BTreeSet::new();
    for s in pool {
        let count = s.spec.pool.resource_slice_count;
        if usize::try_from(count).ok() != Some(pool.len()) {
            push(
                field(s, "spec.pool.resourceSliceCount"),
                invalid(
                    count,
                    format!("the pool has {} slices of this generation", pool.len()),
                ),
            );
        }
        for (i, set) in s.spec.shared_counters.iter().flatten().enumerate() {
            if sets.insert(&set.name, &set.counters).is_some() {
                push(
                    field(s, &format!("spec.sharedCounters[{i}].name")),
                    Problem::Duplicate(set.name.clone()),
                );
            }
        }
        for (i, d) in s.spec.devices.iter().flatten().enumerate() {
            if !devices.insert(&d.name) {
                push(
                    field(s, &format!("spec.devices[{i}].name")),
                    Problem::Duplicate(d.name.clone()),
                );
            }
        }
    }
    consumptions(pool, &sets, &mut push);
}

type Sets<'a> = BTreeMap<&'a str, &'a BTreeMap<String, Counter>>;

/// Each counter a device consumes names a set and a counter of the pool, and no more of it
/// than the set has.
fn consumptions(pool: &[&ResourceSlice], sets: &Sets<'_>, push: &mut impl FnMut(String, Problem)) {
    for s in pool {
        for (i, d) in s.spec.devices.iter().flatten().enumerate() {
            for (j, c) in d.consumes_counters.iter().flatten().enumerate() {
                let path = format!("spec.devices[{i}].consumesCounters[{j}]");
                let Some(set) = sets.get(c.counter_set.as_str()) else {
                    push(
                        field(s, &format!("{path}.counterSet")),
                        invalid(&c.counter_set, "no counter set of this name in the pool"),
                    );
                    continue;
                };
                for (name, wanted) in &c.counters {
                    let p = field(s, &format!("{path}.counters[{name}]"));
                    match set.get(name) {
                        None => push(
                            p,
                            invalid(
                                name,
                                format!("counter set {} has no such counter", c.counter_set),
                            ),
                        ),
                        Some(have) if exceeds(&wanted.value.0, &have.value.0) => push(
                            p,
                            invalid(
                                &wanted.value.0,
                                format!(
                                    "more than counter set {} has ({}): the device could never be allocated",
                                    c.counter_set, have.value.0
                                ),
                            ),
                        ),
                        Some(_) => {}
                    }
                }
            }
        }
    }
}

/// Whether quantity `wanted` is more than `have`; unparsable values are the per-slice
/// validation's to report.
fn exceeds(wanted: &str, have: &str) -> bool {
    match (
        Quantity::parse_trimmed(wanted),
        Quantity::parse_trimmed(have),
    ) {
        (Ok(w), Ok(h)) => w > h,
        _ => false,
    }
}
