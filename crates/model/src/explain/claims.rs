//! The claim side of the explainer: a pod's ResourceClaim requests (from its templates) against
//! the published devices. Only what can be said for sure is said: a request whose DeviceClass
//! does not exist or that no published device may match (selectors that cannot be evaluated
//! count as matching), or an exact count larger than the matching devices free in the whole
//! cluster or on any one node. A device held through the device plugin (our in-use taint) is
//! not free; one with a taint the request does not tolerate is named when it is what is
//! missing. Shares, `All`, `firstAvailable` and constraints are left to the scheduler's own
//! message.

use super::devices::Usable;
use super::{down, health, scheduler_says, spread, Cluster, Reason};
use crate::quota::selector::Selector;
use crate::quota::{CatalogDevice, ClassMatch, DeviceKind};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ExactDeviceRequest, ResourceClaim, ResourceClaimSpec};
use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

/// Request answers memoised for one [`Cluster`], and the pods that hold devices (whose
/// answers depend on which: theirs count as free to them, so they are never memoised).
#[derive(Debug, Default)]
pub(super) struct Answers {
    by_request: Mutex<HashMap<String, Option<(Reason, String)>>>,
    holders: Mutex<Option<BTreeSet<String>>>,
}

impl Answers {
    fn holds(&self, cluster: &Cluster, pod_uid: &str) -> bool {
        let mut h = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        h.get_or_insert_with(|| cluster.taken.values().cloned().collect())
            .contains(pod_uid)
    }
}

/// Devices held by allocated claims: (driver, pool, device) to the holder's uid.
pub(super) fn taken<C: Borrow<ResourceClaim>>(
    claims: &[C],
) -> BTreeMap<(String, String, String), String> {
    let mut out = BTreeMap::new();
    for c in claims.iter().map(Borrow::borrow) {
        let uid = c.metadata.uid.clone().unwrap_or_default();
        let results = c
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_deref())
            .unwrap_or_default();
        for r in results {
            let key = (r.driver.clone(), r.pool.clone(), r.device.clone());
            out.insert(key, uid.clone());
        }
    }
    out
}

/// The first request of the pod's claims that certainly cannot be met, with why.
pub(super) fn answer(pod: &Pod, cluster: &Cluster) -> Option<(Reason, String)> {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    for c in pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
    {
        let Some(t) = &c.resource_claim_template_name else {
            continue;
        };
        let Some(spec) = cluster.templates.get(&(ns.clone(), t.clone())) else {
            return Some((
                Reason::Unknown,
                format!(
                    "its ResourceClaimTemplate {ns}/{t} does not exist; {}",
                    scheduler_says(pod)
                ),
            ));
        };
        if let Some(a) = spec_answer(spec, cluster, &uid) {
            return Some(a);
        }
    }
    None
}

fn spec_answer(
    spec: &ResourceClaimSpec,
    cluster: &Cluster,
    pod_uid: &str,
) -> Option<(Reason, String)> {
    let requests = spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten());
    let memo = !cluster.answers.holds(cluster, pod_uid);
    for r in requests {
        let Some(e) = &r.exactly else { continue };
        let key = memo
            .then(|| serde_json::to_string(e).ok())
            .flatten()
            .map(|e| format!("{}\0{e}", r.name));
        let known = key.as_ref().and_then(|k| {
            let m = cluster
                .answers
                .by_request
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            m.get(k).cloned()
        });
        let a = match known {
            Some(a) => a,
            None => {
                let a = request_answer(&r.name, e, cluster, pod_uid);
                if let Some(k) = key {
                    let mut m = cluster
                        .answers
                        .by_request
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    m.insert(k, a.clone());
                }
                a
            }
        };
        if a.is_some() {
            return a;
        }
    }
    None
}

fn request_answer(
    name: &str,
    e: &ExactDeviceRequest,
    cluster: &Cluster,
    pod_uid: &str,
) -> Option<(Reason, String)> {
    let class = &e.device_class_name;
    let exprs: Vec<&str> = e
        .selectors
        .iter()
        .flatten()
        .filter_map(|s| s.cel.as_ref().map(|c| c.expression.as_str()))
        .collect();
    let selectors: Vec<Selector> = exprs.iter().map(|x| Selector::parse(x)).collect();
    let matching = match cluster.catalog.matching(class, &selectors) {
        ClassMatch::UnknownClass => {
            return Some((
                Reason::Selector,
                format!("request {name}: DeviceClass {class} does not exist"),
            ))
        }
        ClassMatch::NotGpu => return None,
        ClassMatch::Devices(d) => d,
    };
    let down = down::dra_down(&cluster.nodes, cluster.catalog.sliced());
    if matching.is_empty() {
        if !down.is_empty() && of_class(class, cluster).is_empty() {
            let m = format!(
                "request {name}: no device of DeviceClass {class} is published; GPU nodes offering none: {}",
                down::names(&down)
            );
            return Some((Reason::NoGpuCapacity, m));
        }
        return Some((Reason::Selector, no_match(name, class, &exprs, cluster)));
    }
    let exact = e
        .allocation_mode
        .as_deref()
        .is_none_or(|m| m == "ExactCount");
    if !exact || e.capacity.is_some() || matching.iter().any(|d| d.multi_allocatable) {
        return None;
    }
    let count = u64::try_from(e.count.unwrap_or(1)).unwrap_or(0);
    let tolerations = e.tolerations.as_deref().unwrap_or_default();
    let (by_pool, tainted) = free_by_pool(&matching, cluster, pod_uid, tolerations);
    let total: u64 = by_pool.values().sum();
    let needs = format!("request {name} needs {count} device(s) of DeviceClass {class}");
    let all = matching.len();
    let free_text = format!("{total} of the {all} matching free in the cluster");
    if let Some(answer) = down::verdict(&needs, total, count, &free_text, &down) {
        return Some(answer);
    }
    if total < count {
        if let Some(a) = health::claim_answer(&needs, count, total, all, &tainted) {
            return Some(a);
        }
        return Some((Reason::Capacity, format!("{needs}; {free_text}")));
    }
    if by_pool.values().all(|n| *n < count) {
        let free = by_pool.into_iter().collect();
        return Some((Reason::Fragmentation, spread(&needs, free, "pools")));
    }
    None
}

/// Of `matching`, the devices free for this pod (no other claim holds them, not the device
/// plugin's) per pool, and those free but for a taint the request does not tolerate (named).
fn free_by_pool<'a>(
    matching: &[&'a CatalogDevice],
    cluster: &Cluster,
    pod_uid: &str,
    tolerations: &[k8s_openapi::api::resource::v1::DeviceToleration],
) -> (BTreeMap<&'a str, u64>, Vec<String>) {
    let mut by_pool: BTreeMap<&str, u64> = BTreeMap::new();
    let mut tainted = Vec::new();
    for d in matching {
        let key = (d.driver.clone(), d.pool.clone(), d.name.clone());
        if cluster
            .taken
            .get(&key)
            .is_some_and(|holder| holder != pod_uid)
        {
            continue;
        }
        let usable = d.facts.usable(tolerations);
        match usable {
            Usable::Yes => *by_pool.entry(d.pool.as_str()).or_insert(0) += 1,
            Usable::InUse => {}
            Usable::Tainted(t) => tainted.push(format!("{}/{} {t}", d.pool, d.name)),
        }
    }
    (by_pool, tainted)
}

/// "request gpu: no device of DeviceClass C matches <exprs>; this cluster has A x 8, B x 2".
fn no_match(name: &str, class: &str, exprs: &[&str], cluster: &Cluster) -> String {
    let of_class = of_class(class, cluster);
    if of_class.is_empty() {
        let has = summary(cluster.catalog.devices().iter().map(|d| &**d));
        return format!(
            "request {name}: no published GPU device is of DeviceClass {class}; this cluster has {has}"
        );
    }
    let has = summary(of_class.into_iter());
    let exprs = exprs.join(" && ");
    format!(
        "request {name}: no device of DeviceClass {class} matches {exprs}; this cluster has {has}"
    )
}

/// The published devices of DeviceClass `class`, whatever they are.
fn of_class<'a>(class: &str, cluster: &'a Cluster) -> Vec<&'a CatalogDevice> {
    match cluster.catalog.matching(class, &[]) {
        ClassMatch::Devices(d) => d,
        _ => Vec::new(),
    }
}

/// "A x 8, B MIG 1g.10gb x 2": devices by product (and MIG profile).
fn summary<'a>(devices: impl Iterator<Item = &'a CatalogDevice>) -> String {
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for d in devices {
        let product = d
            .product
            .clone()
            .unwrap_or_else(|| "unknown product".into());
        let kind = match &d.kind {
            DeviceKind::Mig { profile } => format!("{product} MIG {profile}"),
            _ => product,
        };
        *kinds.entry(kind).or_insert(0) += 1;
    }
    if kinds.is_empty() {
        return "no published GPU device".into();
    }
    let each: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} x {n}")).collect();
    each.join(", ")
}
