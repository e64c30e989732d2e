//! What preparing a ResourceClaim means on this node: a pure decision over the claim object,
//! the inventory and the health book ([`plan_claim`]), and the one I/O it needs, reading the
//! claim from the API server (the shell's `ClaimFetcher`, `KubeClaims`).
//!
//! Rules, from the resource.k8s.io/v1 API:
//!
//! - the claim's `metadata.uid` must be the UID the kubelet named: a different UID is a claim
//!   deleted and re-created under the same name, and must not be prepared in its place;
//! - the devices are `status.allocation.devices.results` whose `driver` is ours. Results of
//!   other drivers belong to them. One of ours in another `pool` (pools are named after nodes)
//!   was allocated for another node and is an error;
//! - each device must exist in the inventory under its DRA name and be healthy;
//! - configs come from `status.allocation.devices.config`, where the scheduler copied the
//!   class configs (`source: FromClass`) and the claim's own (`FromClaim`) at allocation time.
//!   The claim's `spec.devices.config` is not read as well: the allocation's copy is the
//!   authoritative one and reading both would apply the claim's configs twice. Only configs
//!   whose `opaque.driver` is ours are decoded (all of them, strictly, whether or not they end up
//!   applying); the others are left to their drivers. A config applies to the requests it lists
//!   (`main` covers `main/<sub>`), or to all requests when it lists none. Class configs come
//!   before claim configs and, within each, later ones before earlier ones: the last config
//!   that applies to a device wins (NVIDIA's driver does the same).
//! - a result with a `shareID` or `consumedCapacity` is a share of a shared unit
//!   ([`crate::sharing`]): the unit must be shared on this node, and the share is read from
//!   `consumedCapacity` (never the request, which the scheduler rounds) and checked against the
//!   unit's published policy. A config of ours with its own `sharing` settings contradicts it
//!   (the share's limits come from its allocation) and is refused.

use super::opaque::{self, GpuConfig, OpaqueError};
use super::ClaimRef;
use crate::health::{Health, HealthBook};
use crate::inventory::{DeviceRef, DeviceUuid, Inventory};
use crate::report::chain;
use crate::sharing::{share_from_consumed, Share, ShareError, UnitShares};
use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequestAllocationResult, ResourceClaim,
};
use std::collections::BTreeMap;

/// Where an allocation config came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConfigSource {
    FromClass,
    FromClaim,
}

impl ConfigSource {
    pub fn as_str(self) -> &'static str {
        match self {
            ConfigSource::FromClass => "FromClass",
            ConfigSource::FromClaim => "FromClaim",
        }
    }
}

impl std::fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a claim cannot be prepared on this node. The caller adds which claim it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("the claim's UID is {found}, not {expected} (deleted and re-created?)")]
    UidMismatch { expected: String, found: String },
    #[error("the claim is not allocated")]
    NotAllocated,
    #[error("the allocation has no device of driver {driver}")]
    NoDevices { driver: String },
    #[error(
        "request {request}: device {device} is in pool {pool}, not this node's pool {expected}"
    )]
    OtherPool {
        request: String,
        device: String,
        pool: String,
        expected: String,
    },
    #[error("request {request}: device {device} does not exist on this node")]
    UnknownDevice { request: String, device: String },
    #[error("device {device} ({uuid}) is unhealthy: {cause}")]
    Unhealthy {
        device: String,
        uuid: String,
        cause: String,
    },
    #[error("allocation config #{index} has source `{value}`, expected FromClass or FromClaim")]
    UnknownSource { index: usize, value: String },
    #[error("allocation config #{index} ({origin}): {}", chain(.cause))]
    BadConfig {
        index: usize,
        origin: ConfigSource,
        cause: OpaqueError,
    },
    #[error("allocation config #{index} ({origin}) for devices {devices} asks for what this node does not do: {}", chain(.cause))]
    NotSupported {
        index: usize,
        origin: ConfigSource,
        devices: String,
        cause: OpaqueError,
    },
    #[error("request {request}: device {device} is allocated as a share (shareID {share_id}), but this node does not share it; the allocation is stale, delete the pod and claim to allocate again")]
    NotShared {
        request: String,
        device: String,
        share_id: String,
    },
    #[error("request {request}: the share of device {device} cannot be given: {cause}")]
    BadShare {
        request: String,
        device: String,
        cause: ShareError,
    },
    #[error("device {device} is allocated as a share under MPS, and the claim has {count} devices; an MPS share must be its claim's only device: ask for each share in a claim of its own")]
    MpsShareNotAlone { device: String, count: usize },
    #[error("allocation config #{index} ({origin}) sets sharing strategy {strategy} for device {device}, which is allocated as a share whose limits come from its allocation; remove the sharing settings from the config")]
    SharingOnShare {
        index: usize,
        origin: ConfigSource,
        strategy: &'static str,
        device: String,
    },
    #[error("device {device} gets config #{first} through request {first_request} and config #{second} through request {second_request}")]
    ConflictingConfigs {
        device: String,
        first: String,
        first_request: String,
        second: String,
        second_request: String,
    },
}

/// A config of ours that applies to a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedConfig {
    /// Position in `status.allocation.devices.config`.
    pub index: usize,
    pub origin: ConfigSource,
    pub config: GpuConfig,
}

/// One device to prepare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedDevice {
    /// The requests (`main` or `main/sub`) this device was allocated for.
    pub requests: Vec<String>,
    /// DRA device name.
    pub device: String,
    /// The unit's UUID (GPU or MIG device).
    pub uuid: DeviceUuid,
    pub share_id: Option<String>,
    /// What a share consumes (from `consumedCapacity`), with the unit's policy; `None` for a
    /// whole device.
    pub share: Option<(Share, UnitShares)>,
    pub config: Option<AppliedConfig>,
    /// What the config means for the container ([`opaque::container_env`]).
    pub env: Vec<String>,
}

/// The devices of a claim for this driver and node, in allocation order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClaimPlan {
    pub devices: Vec<PlannedDevice>,
}

impl ClaimPlan {
    /// The distinct DRA device names (a device allocated with several share ids appears once).
    pub fn device_names(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for d in &self.devices {
            if !out.contains(&d.device.as_str()) {
                out.push(&d.device);
            }
        }
        out
    }
}

/// Does a config's `requests` entry cover the result's `request` (`main` or `main/sub`)?
fn covers(config_request: &str, result_request: &str) -> bool {
    result_request == config_request
        || result_request
            .strip_prefix(config_request)
            .is_some_and(|rest| rest.starts_with('/'))
}

struct OurConfig<'a> {
    index: usize,
    origin: ConfigSource,
    requests: &'a [String],
    config: GpuConfig,
}

/// Our driver's configs, decoded, in precedence order (lowest first).
fn our_configs<'a>(
    configs: &'a [DeviceAllocationConfiguration],
    driver: &str,
) -> Result<Vec<OurConfig<'a>>, ClaimError> {
    let mut out = Vec::new();
    for (index, c) in configs.iter().enumerate() {
        let Some(opaque) = c.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        let origin = match c.source.as_str() {
            "FromClass" => ConfigSource::FromClass,
            "FromClaim" => ConfigSource::FromClaim,
            other => {
                return Err(ClaimError::UnknownSource {
                    index,
                    value: other.to_string(),
                })
            }
        };
        let config =
            opaque::parse(&opaque.parameters.0).map_err(|source| ClaimError::BadConfig {
                index,
                origin,
                cause: source,
            })?;
        out.push(OurConfig {
            index,
            origin,
            requests: c.requests.as_deref().unwrap_or_default(),
            config,
        });
    }
    // Stable: class configs first, each group in its listed order.
    out.sort_by_key(|c| c.origin);
    Ok(out)
}

fn config_for<'c>(configs: &'c [OurConfig<'_>], request: &str) -> Option<&'c OurConfig<'c>> {
    configs
        .iter()
        .rev()
        .find(|c| c.requests.is_empty() || c.requests.iter().any(|r| covers(r, request)))
}

/// Decides what preparing `claim` on this node means, or why it cannot be prepared.
pub fn plan_claim(
    claim: &ResourceClaim,
    claim_ref: &ClaimRef,
    driver: &str,
    pool: &str,
    inv: &Inventory,
    health: &HealthBook,
    shared: &BTreeMap<DeviceUuid, UnitShares>,
) -> Result<ClaimPlan, ClaimError> {
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim_ref.uid {
        return Err(ClaimError::UidMismatch {
            expected: claim_ref.uid.to_string(),
            found: if uid.is_empty() {
                "empty".into()
            } else {
                uid.to_string()
            },
        });
    }
    let devices = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or(ClaimError::NotAllocated)?;
    let configs = our_configs(devices.config.as_deref().unwrap_or_default(), driver)?;

    let mut plan = ClaimPlan::default();
    let mut chosen = Chosen::new();
    for result in devices
        .results
        .iter()
        .flatten()
        .filter(|r| r.driver == driver)
    {
        let dev = allocated_device(result, pool, inv, health)?;
        let config = config_for(&configs, &result.request);
        choose_config(&mut chosen, result, config.map(|c| c.index))?;
        let share = allocated_share(result, shared.get(dev.uuid()))?;
        if let (Some(_), Some(c)) = (share, config) {
            if let Some(s) = &c.config.sharing {
                return Err(ClaimError::SharingOnShare {
                    index: c.index,
                    origin: c.origin,
                    strategy: s.strategy(),
                    device: result.device.clone(),
                });
            }
        }
        plan.add(result, dev, config, share);
    }
    if plan.devices.is_empty() {
        return Err(ClaimError::NoDevices {
            driver: driver.to_string(),
        });
    }
    if let Some(p) = plan.devices.iter().find(|p| {
        p.share
            .is_some_and(|(_, u)| u.enforcement == crate::sharing::Enforcement::Mps)
    }) {
        if plan.devices.len() > 1 {
            return Err(ClaimError::MpsShareNotAlone {
                device: p.device.clone(),
                count: plan.devices.len(),
            });
        }
    }
    apply_env(&mut plan, &configs, &chosen)?;
    Ok(plan)
}

/// Per planned device: the config index it got, and through which request.
type Chosen = BTreeMap<String, (Option<usize>, String)>;

/// The inventory device an allocation result names, if it is in our pool and healthy.
fn allocated_device<'i>(
    result: &DeviceRequestAllocationResult,
    pool: &str,
    inv: &'i Inventory,
    health: &HealthBook,
) -> Result<DeviceRef<'i>, ClaimError> {
    if result.pool != pool {
        return Err(ClaimError::OtherPool {
            request: result.request.clone(),
            device: result.device.clone(),
            pool: result.pool.clone(),
            expected: pool.to_string(),
        });
    }
    let dev = inv
        .dra_device(&result.device)
        .ok_or_else(|| ClaimError::UnknownDevice {
            request: result.request.clone(),
            device: result.device.clone(),
        })?;
    if let Health::Unhealthy(cause) = health.health(dev.uuid()) {
        return Err(ClaimError::Unhealthy {
            device: result.device.clone(),
            uuid: dev.uuid().to_string(),
            cause: cause.to_string(),
        });
    }
    Ok(dev)
}

/// The share a result is, read from its `consumedCapacity` and checked against the unit's
/// policy; `None` for a whole-device allocation.
fn allocated_share(
    result: &DeviceRequestAllocationResult,
    unit: Option<&UnitShares>,
) -> Result<Option<(Share, UnitShares)>, ClaimError> {
    if result.share_id.is_none() && result.consumed_capacity.is_none() {
        return Ok(None);
    }
    let Some(unit) = unit else {
        return Err(ClaimError::NotShared {
            request: result.request.clone(),
            device: result.device.clone(),
            share_id: result.share_id.clone().unwrap_or_else(|| "none".into()),
        });
    };
    let bad = |cause| ClaimError::BadShare {
        request: result.request.clone(),
        device: result.device.clone(),
        cause,
    };
    let consumed = result.consumed_capacity.clone().unwrap_or_default();
    let share = share_from_consumed(&consumed).map_err(bad)?;
    unit.check(&share).map_err(bad)?;
    Ok(Some((share, *unit)))
}

/// Records the config a result's device gets; a device reached through several requests must
/// get the same one through each.
fn choose_config(
    chosen: &mut Chosen,
    result: &DeviceRequestAllocationResult,
    index: Option<usize>,
) -> Result<(), ClaimError> {
    match chosen.get(&result.device) {
        Some((prev, prev_request)) if *prev != index => {
            let show = |i: Option<usize>| i.map_or_else(|| "none".to_string(), |i| i.to_string());
            return Err(ClaimError::ConflictingConfigs {
                device: result.device.clone(),
                first: show(*prev),
                first_request: prev_request.clone(),
                second: show(index),
                second_request: result.request.clone(),
            });
        }
        Some(_) => {}
        None => {
            chosen.insert(result.device.clone(), (index, result.request.clone()));
        }
    }
    Ok(())
}

impl ClaimPlan {
    /// Adds an allocation result: a new planned device, or one more request of a device
    /// (and share) already planned.
    fn add(
        &mut self,
        result: &DeviceRequestAllocationResult,
        dev: DeviceRef<'_>,
        config: Option<&OurConfig<'_>>,
        share: Option<(Share, UnitShares)>,
    ) {
        let existing = self
            .devices
            .iter_mut()
            .find(|p| p.device == result.device && p.share_id == result.share_id);
        match existing {
            Some(p) => {
                if !p.requests.contains(&result.request) {
                    p.requests.push(result.request.clone());
                }
            }
            None => self.devices.push(PlannedDevice {
                requests: vec![result.request.clone()],
                device: result.device.clone(),
                uuid: dev.uuid().clone(),
                share_id: result.share_id.clone(),
                share,
                config: config.map(|c| AppliedConfig {
                    index: c.index,
                    origin: c.origin,
                    config: c.config.clone(),
                }),
                env: Vec::new(),
            }),
        }
    }
}

/// The environment of each config's device group, set on every planned device of the group.
fn apply_env(
    plan: &mut ClaimPlan,
    configs: &[OurConfig<'_>],
    chosen: &Chosen,
) -> Result<(), ClaimError> {
    for c in configs {
        let group: Vec<String> = plan
            .device_names()
            .into_iter()
            .filter(|name| chosen.get(*name).is_some_and(|(i, _)| *i == Some(c.index)))
            .map(str::to_string)
            .collect();
        if group.is_empty() {
            continue;
        }
        let env = opaque::container_env(&c.config).map_err(|source| ClaimError::NotSupported {
            index: c.index,
            origin: c.origin,
            devices: group.join(", "),
            cause: source,
        })?;
        for p in plan
            .devices
            .iter_mut()
            .filter(|p| group.contains(&p.device))
        {
            p.env = env.clone();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::Cause;
    use serde_json::json;
    use std::time::Instant;

    const DRIVER: &str = "gpu.gpuplane.dev";
    const POOL: &str = "node-a";
    const UID: &str = "0b5c3f2e-1111-4222-8333-444455556666";

    fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "ns", "name": "c", "uid": UID},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap()
    }

    fn result(request: &str, device: &str) -> serde_json::Value {
        json!({"request": request, "driver": DRIVER, "pool": POOL, "device": device})
    }

    fn cref() -> ClaimRef {
        ClaimRef::parse("ns", UID, "c").unwrap()
    }

    fn setup() -> (Inventory, HealthBook) {
        let inv = crate::sim::load("a100-mig-mixed").unwrap();
        let mut health = HealthBook::default();
        health.set_inventory(&inv);
        (inv, health)
    }

    fn plan(c: &ResourceClaim) -> Result<ClaimPlan, ClaimError> {
        let (inv, health) = setup();
        plan_claim(c, &cref(), DRIVER, POOL, &inv, &health, &BTreeMap::new())
    }

    fn cfg(
        source: &str,
        requests: serde_json::Value,
        sharing: serde_json::Value,
    ) -> serde_json::Value {
        json!({"source": source, "requests": requests, "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": opaque::API_VERSION, "kind": opaque::KIND, "sharing": sharing}}})
    }

    #[test]
    fn plans_our_devices_and_ignores_other_drivers() {
        let mut other = result("nic", "eth0");
        other["driver"] = json!("net.example.com");
        other["pool"] = json!("elsewhere");
        let c = claim(
            json!([
                result("gpu", "gpu-3"),
                other,
                result("mig", "gpu-0-mig-3g20gb-1")
            ]),
            json!([{"source": "FromClaim", "opaque": {"driver": "net.example.com", "parameters": {"whatever": 1}}}]),
        );
        let p = plan(&c).unwrap();
        assert_eq!(p.device_names(), vec!["gpu-3", "gpu-0-mig-3g20gb-1"]);
        assert_eq!(p.devices[0].requests, vec!["gpu"]);
        assert!(
            p.devices[0].uuid.starts_with("GPU-"),
            "{}",
            p.devices[0].uuid
        );
        assert!(
            p.devices[1].uuid.starts_with("MIG-"),
            "{}",
            p.devices[1].uuid
        );
        assert!(p
            .devices
            .iter()
            .all(|d| d.config.is_none() && d.env.is_empty()));
    }

    #[test]
    fn claim_configs_override_class_configs_per_request() {
        let ts = json!({"strategy": "TimeSlicing"});
        let none = json!(null);
        // Listed claim-first on purpose: precedence comes from the source, not the order.
        let c = claim(
            json!([
                result("a", "gpu-3"),
                result("b/small", "gpu-0-mig-3g20gb-1")
            ]),
            json!([
                cfg("FromClaim", json!(["b"]), none),
                cfg("FromClass", json!([]), ts)
            ]),
        );
        let p = plan(&c).unwrap();
        assert_eq!(
            p.devices[0].config.as_ref().unwrap().origin,
            ConfigSource::FromClass
        );
        assert_eq!(
            p.devices[0].env,
            vec!["GPUPLANE_SHARING_STRATEGY=TimeSlicing"]
        );
        assert_eq!(p.devices[1].config.as_ref().unwrap().index, 0);
        assert!(p.devices[1].env.is_empty(), "{:?}", p.devices[1].env);
    }

    #[test]
    fn errors() {
        let mut wrong_uid = claim(json!([result("gpu", "gpu-3")]), json!([]));
        wrong_uid.metadata.uid = Some("ffff".into());
        assert!(matches!(
            plan(&wrong_uid),
            Err(ClaimError::UidMismatch { .. })
        ));

        let mut unallocated = claim(json!([]), json!([]));
        unallocated.status = None;
        assert_eq!(plan(&unallocated), Err(ClaimError::NotAllocated));

        let mut elsewhere = result("gpu", "gpu-3");
        elsewhere["pool"] = json!("node-b");
        let e = plan(&claim(json!([elsewhere]), json!([]))).unwrap_err();
        assert!(e.to_string().contains("pool node-b"), "{e}");

        let e = plan(&claim(json!([result("gpu", "gpu-0")]), json!([]))).unwrap_err();
        assert_eq!(
            e,
            ClaimError::UnknownDevice {
                request: "gpu".into(),
                device: "gpu-0".into()
            }
        );

        let mut other_driver = result("gpu", "gpu-3");
        other_driver["driver"] = json!("gpu.nvidia.com");
        assert!(matches!(
            plan(&claim(json!([other_driver]), json!([]))),
            Err(ClaimError::NoDevices { .. })
        ));

        let bad = cfg(
            "FromClaim",
            json!([]),
            json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
        );
        let e = plan(&claim(json!([result("gpu", "gpu-3")]), json!([bad]))).unwrap_err();
        assert!(
            e.to_string().contains("defaultActiveThreadPercentage"),
            "{e}"
        );
        // The cause is in the message once, not also a source() (crate::report).
        assert!(std::error::Error::source(&e).is_none());

        // Accepted as written (NVIDIA's syntax), refused at prepare: nothing would carry it out.
        for sharing in [
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}),
            json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}),
        ] {
            let c = cfg("FromClass", json!([]), sharing);
            let e = plan(&claim(json!([result("gpu", "gpu-3")]), json!([c]))).unwrap_err();
            assert!(matches!(e, ClaimError::NotSupported { .. }), "{e}");
            assert!(e.to_string().contains("gpu-3"), "{e}");
        }

        let (inv, mut health) = setup();
        let uuid = inv.dra_device("gpu-3").unwrap().uuid().clone();
        let policy = crate::config::AgentConfig::default().xid_policy;
        health.on_event(
            &crate::source::DeviceEvent::Xid {
                gpu_uuid: uuid,
                mig_uuid: None,
                xid: 48,
            },
            Instant::now(),
            &policy,
        );
        let e = plan_claim(
            &claim(json!([result("gpu", "gpu-3")]), json!([])),
            &cref(),
            DRIVER,
            POOL,
            &inv,
            &health,
            &BTreeMap::new(),
        )
        .unwrap_err();
        assert!(e.to_string().contains(&Cause::Xid(48).to_string()), "{e}");
    }

    #[test]
    fn request_matching() {
        assert!(covers("a", "a"));
        assert!(covers("a", "a/x"));
        assert!(!covers("a", "ab"));
        assert!(!covers("a/x", "a"));
        assert!(covers("a/x", "a/x"));
    }
}
