//! What a pod or a ResourceClaim costs against a GpuQuota (pure).
//!
//! **Pods** are charged for
//! - GPU device-plugin resources of their containers (see [`super::catalog`] for which names
//!   and how they are priced), combined as Kubernetes does: per resource,
//!   `max(sum(app containers) + sum(sidecars), max over init containers of (init + the sidecars
//!   started before it))`; requests and limits of extended resources are equal, and a container
//!   giving only limits requests its limits;
//! - every `resourceClaims[]` entry made from a ResourceClaimTemplate (the claim the
//!   resourceclaim controller creates from it is owned by the pod and not charged again).
//!   Entries naming an existing claim (`resourceClaimName`) are not charged to the pod: that
//!   claim was charged when it was created.
//!
//! **Claims** (and templates) are charged per request, as Kubernetes' own quota counts them:
//! `exactly` with `ExactCount` charges `count` (default 1) devices of its class; `All` charges
//! 32 devices (`AllocationResultsMaxSize`, the most one request can get); `firstAvailable`
//! charges, per dimension, the largest of its subrequests (the worst case). GPUs and GPU
//! memory are the worst case among the published devices the class and selectors may match:
//! `count` x the largest share and the largest memory for `ExactCount`, and for `All` the largest
//! sum over one pool (one node's devices).
//!
//! A request naming capacities (`capacity.requests`) may get only devices that publish them and
//! can grant them; on a multi-allocatable device it gets a share, which costs what it consumes
//! ([`super::share`]): the worst case is taken over shared and whole devices alike.
//!
//! Once a claim is allocated, [`settled_claim_charge`] gives its actual cost from
//! `status.allocation` and the slices: the controller replaces the worst case with it.

use super::catalog::{CatalogDevice, ClassMatch, DeviceCatalog};
use super::ratio::QuotaMathError;
use super::selector::Selector;
use super::share::{allocation_charge, settled_share_charge, CapacityAmounts};
use super::usage::Charge;
use crate::quantity::QuantityError;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceRequestAllocationResult, DeviceSelector, ResourceClaim,
    ResourceClaimSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::collections::BTreeMap;

/// Devices charged for an `All` request: Kubernetes' `AllocationResultsMaxSize`.
pub const ALL_MODE_DEVICES: u64 = 32;

/// Why a charge could not be computed at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChargeError {
    #[error("container {container}: {resource}: {value:?} is not a whole, non-negative number of devices")]
    BadQuantity {
        container: String,
        resource: String,
        value: String,
    },
    #[error("ResourceClaimTemplate {0:?} (used by resourceClaims[].resourceClaimTemplateName) was not found")]
    MissingTemplate(String),
    #[error("request {request:?}: count {count} is not a positive number of devices")]
    BadCount { request: String, count: i64 },
    #[error("request {request:?}: unknown allocationMode {mode:?} (want ExactCount or All)")]
    BadMode { request: String, mode: String },
    #[error("request {request:?}: capacity {capacity}: {value:?} is not a quantity: {reason}")]
    BadCapacity {
        request: String,
        capacity: String,
        value: String,
        reason: QuantityError,
    },
    #[error("request {0:?} has neither `exactly` nor `firstAvailable`")]
    EmptyRequest(String),
    #[error("allocation result for request {0:?} names no request of the claim")]
    UnknownRequest(String),
    #[error(transparent)]
    Math(#[from] QuotaMathError),
}

/// A device count: a whole, non-negative quantity (`2`, `1000m`; not `500m` or `-1`).
pub(crate) fn quantity_count(q: &Quantity) -> Option<u64> {
    let q = crate::quantity::Quantity::parse_trimmed(&q.0).ok()?;
    if !q.is_integer() || q.is_negative() {
        return None;
    }
    q.value().and_then(|v| u64::try_from(v).ok())
}

/// One container's GPU device-plugin requests.
fn container_counts(
    c: &Container,
    catalog: &DeviceCatalog,
) -> Result<BTreeMap<String, u64>, ChargeError> {
    let mut out = BTreeMap::new();
    let Some(res) = &c.resources else {
        return Ok(out);
    };
    let names = res
        .requests
        .iter()
        .flatten()
        .chain(res.limits.iter().flatten())
        .map(|(k, _)| k.clone());
    for name in names {
        if !catalog.is_gpu_resource(&name) || out.contains_key(&name) {
            continue;
        }
        let mut n = 0u64;
        for q in [
            res.requests.as_ref().and_then(|r| r.get(&name)),
            res.limits.as_ref().and_then(|r| r.get(&name)),
        ]
        .into_iter()
        .flatten()
        {
            let v = quantity_count(q).ok_or_else(|| ChargeError::BadQuantity {
                container: c.name.clone(),
                resource: name.clone(),
                value: q.0.clone(),
            })?;
            n = n.max(v);
        }
        out.insert(name, n);
    }
    Ok(out)
}

fn add_counts(
    a: &mut BTreeMap<String, u64>,
    b: &BTreeMap<String, u64>,
) -> Result<(), QuotaMathError> {
    for (k, v) in b {
        let e = a.entry(k.clone()).or_insert(0);
        *e = e.checked_add(*v).ok_or(QuotaMathError::Overflow)?;
    }
    Ok(())
}

fn max_counts(a: &mut BTreeMap<String, u64>, b: &BTreeMap<String, u64>) {
    for (k, v) in b {
        let e = a.entry(k.clone()).or_insert(0);
        *e = (*e).max(*v);
    }
}

/// The pod's effective GPU device-plugin requests, by resource name, with Kubernetes' rule for
/// init containers and sidecars (restartable init containers).
pub fn pod_resource_counts(
    pod: &Pod,
    catalog: &DeviceCatalog,
) -> Result<BTreeMap<String, u64>, ChargeError> {
    let Some(spec) = &pod.spec else {
        return Ok(BTreeMap::new());
    };
    let mut reqs = BTreeMap::new();
    for c in &spec.containers {
        add_counts(&mut reqs, &container_counts(c, catalog)?)?;
    }
    let mut sidecars = BTreeMap::new();
    let mut init_max = BTreeMap::new();
    for c in spec.init_containers.iter().flatten() {
        let own = container_counts(c, catalog)?;
        let effective = if c.restart_policy.as_deref() == Some("Always") {
            add_counts(&mut reqs, &own)?;
            add_counts(&mut sidecars, &own)?;
            sidecars.clone()
        } else {
            let mut t = own;
            add_counts(&mut t, &sidecars)?;
            t
        };
        max_counts(&mut init_max, &effective);
    }
    max_counts(&mut reqs, &init_max);
    reqs.retain(|_, v| *v != 0);
    Ok(reqs)
}

/// ResourceClaimTemplates the pod's claims are made from; the caller fetches them for
/// [`pod_charge`].
pub fn pod_template_names(pod: &Pod) -> Vec<String> {
    let mut out: Vec<String> = pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_template_name.clone())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// What the pod costs at admission (worst case). `templates` maps template name to its claim
/// spec; a template the pod uses that is missing is an error.
pub fn pod_charge(
    pod: &Pod,
    templates: &BTreeMap<String, ResourceClaimSpec>,
    catalog: &DeviceCatalog,
) -> Result<Charge, ChargeError> {
    let mut charge = Charge::default();
    for (resource, n) in pod_resource_counts(pod, catalog)? {
        if let Some(c) = catalog.resource_charge(&resource, n) {
            charge.add_assign(&c?)?;
        }
    }
    for c in pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
    {
        if let Some(t) = &c.resource_claim_template_name {
            let spec = templates
                .get(t)
                .ok_or_else(|| ChargeError::MissingTemplate(t.clone()))?;
            charge.add_assign(&claim_charge(spec, catalog)?)?;
        }
    }
    Ok(charge)
}

fn selectors(s: &Option<Vec<DeviceSelector>>) -> Vec<Selector> {
    s.iter()
        .flatten()
        .map(|s| Selector::parse(s.cel.as_ref().map(|c| c.expression.as_str()).unwrap_or("")))
        .collect()
}

/// One (sub)request's worst case.
fn request_charge(
    request: &str,
    class: &str,
    sels: &Option<Vec<DeviceSelector>>,
    mode: Option<&str>,
    count: Option<i64>,
    capacity: Option<&CapacityRequirements>,
    catalog: &DeviceCatalog,
) -> Result<Charge, ChargeError> {
    let all = match mode.unwrap_or("ExactCount") {
        "ExactCount" => false,
        "All" => true,
        m => {
            return Err(ChargeError::BadMode {
                request: request.into(),
                mode: m.into(),
            })
        }
    };
    let n = if all {
        ALL_MODE_DEVICES
    } else {
        let c = count.unwrap_or(1);
        u64::try_from(c)
            .ok()
            .filter(|c| *c > 0)
            .ok_or(ChargeError::BadCount {
                request: request.into(),
                count: c,
            })?
    };
    let asked = CapacityAmounts::read(capacity.and_then(|c| c.requests.as_ref())).map_err(
        |(capacity, value, reason)| ChargeError::BadCapacity {
            request: request.into(),
            capacity,
            value,
            reason,
        },
    )?;
    let mut charge = match catalog.matching(class, &selectors(sels)) {
        ClassMatch::NotGpu => Charge::default(),
        ClassMatch::UnknownClass => Charge::unknown_gpus(format!(
            "DeviceClass {class} (request {request}) is not known"
        )),
        ClassMatch::Devices(ds) => {
            let what = if asked.is_empty() {
                format!("DeviceClass {class}")
            } else {
                format!("DeviceClass {class} with the capacities request {request} asks")
            };
            devices_charge(&ds, &asked, all, n, &what)?
        }
    };
    charge.usage.devices.insert(class.to_string(), n);
    Ok(charge)
}

/// `n` allocations among `ds` (`all`: one on each device of the most costly pool, one node's
/// devices), each priced by [`allocation_charge`]; devices it rules out are skipped.
fn devices_charge(
    ds: &[&CatalogDevice],
    asked: &CapacityAmounts,
    all: bool,
    n: u64,
    what: &str,
) -> Result<Charge, QuotaMathError> {
    let costs: Vec<(&CatalogDevice, Charge)> = ds
        .iter()
        .filter_map(|d| Some((*d, allocation_charge(d, asked)?)))
        .collect();
    if !all || costs.is_empty() {
        let each: Vec<Charge> = costs.into_iter().map(|(_, c)| c).collect();
        return DeviceCatalog::worst_device(&each, what).checked_mul_int(if all { 1 } else { n });
    }
    let mut pools: BTreeMap<(&str, &str), Charge> = BTreeMap::new();
    for (d, c) in &costs {
        pools
            .entry((d.driver.as_str(), d.pool.as_str()))
            .or_default()
            .add_assign(c)?;
    }
    Ok(pools
        .values()
        .fold(Charge::default(), |worst, c| worst.max(c)))
}

/// What a claim (or a template's claim) costs before allocation (worst case).
pub fn claim_charge(
    spec: &ResourceClaimSpec,
    catalog: &DeviceCatalog,
) -> Result<Charge, ChargeError> {
    let mut total = Charge::default();
    for r in spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
    {
        let c = if let Some(e) = &r.exactly {
            request_charge(
                &r.name,
                &e.device_class_name,
                &e.selectors,
                e.allocation_mode.as_deref(),
                e.count,
                e.capacity.as_ref(),
                catalog,
            )?
        } else if let Some(subs) = r.first_available.as_ref().filter(|s| !s.is_empty()) {
            let mut worst = Charge::default();
            for s in subs {
                let name = format!("{}/{}", r.name, s.name);
                worst = worst.max(&request_charge(
                    &name,
                    &s.device_class_name,
                    &s.selectors,
                    s.allocation_mode.as_deref(),
                    s.count,
                    s.capacity.as_ref(),
                    catalog,
                )?);
            }
            worst
        } else {
            return Err(ChargeError::EmptyRequest(r.name.clone()));
        };
        total.add_assign(&c)?;
    }
    Ok(total)
}

/// The DeviceClass of request `name` (`req` or `req/sub`) of a claim.
fn class_of<'a>(spec: &'a ResourceClaimSpec, name: &str) -> Option<&'a str> {
    let (main, sub) = match name.split_once('/') {
        Some((m, s)) => (m, Some(s)),
        None => (name, None),
    };
    let r = spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
        .find(|r| r.name == main)?;
    match sub {
        None => r.exactly.as_ref().map(|e| e.device_class_name.as_str()),
        Some(s) => r
            .first_available
            .iter()
            .flatten()
            .find(|x| x.name == s)
            .map(|x| x.device_class_name.as_str()),
    }
}

/// The actual cost of an allocated claim: per allocated device, one device of its request's
/// class, and the device's share and memory as published; a share (a result with
/// `consumedCapacity`) what it consumed. `Ok(None)` while unallocated. A device of another
/// driver costs only its count; a GPU-driver device no longer published leaves an unknown
/// (unless its share's consumption says it all), and the caller then keeps the admission-time
/// (worst-case) charge.
pub fn settled_claim_charge(
    claim: &ResourceClaim,
    catalog: &DeviceCatalog,
) -> Result<Option<Charge>, ChargeError> {
    let Some(results) = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .map(|d| d.results.clone().unwrap_or_default())
    else {
        return Ok(None);
    };
    let mut total = Charge::default();
    for r in &results {
        let class = class_of(&claim.spec, &r.request)
            .ok_or_else(|| ChargeError::UnknownRequest(r.request.clone()))?;
        let mut c = if catalog.settings().drivers.contains(&r.driver) {
            result_charge(r, catalog)
        } else {
            Charge::default()
        };
        c.usage.devices.insert(class.to_string(), 1);
        total.add_assign(&c)?;
    }
    Ok(Some(total))
}

/// The share and memory of one allocated GPU-driver device.
fn result_charge(r: &DeviceRequestAllocationResult, catalog: &DeviceCatalog) -> Charge {
    let device = catalog.device(&r.driver, &r.pool, &r.device);
    let what = format!("allocated device {}/{}/{}", r.driver, r.pool, r.device);
    // The scheduler fills `consumedCapacity` for shares only (an empty map is no share).
    let consumed = CapacityAmounts::readable(r.consumed_capacity.as_ref());
    if !consumed.is_empty() {
        return settled_share_charge(&consumed, &r.driver, device, &what);
    }
    match device {
        Some(d) => DeviceCatalog::device_usage(d),
        None => Charge::unknown_gpus(format!("{what} is not published")),
    }
}

/// Whether the scheduler made this claim for a pod's extended resources backed by a
/// DeviceClass (`extendedResourceName`; annotation `resource.kubernetes.io/extended-resource-claim`):
/// the pod's `nvidia.com/gpu` is charged through the pod, so its claim must not be again.
pub fn claim_is_extended_resource_claim(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> bool {
    claim_is_pod_owned(meta)
        && meta.annotations.as_ref().is_some_and(|a| {
            a.get("resource.kubernetes.io/extended-resource-claim")
                .is_some_and(|v| v == "true")
        })
}

/// Whether a ResourceClaim was made from a pod's template (owned by a Pod, or annotated
/// `resource.kubernetes.io/pod-claim-name`): such claims are charged through the pod.
pub fn claim_is_pod_owned(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> bool {
    meta.annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("resource.kubernetes.io/pod-claim-name"))
        || meta
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Pod" && o.api_version == "v1" && o.controller == Some(true))
}
