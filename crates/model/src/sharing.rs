//! Fractional GPUs through DRA consumable capacity (pure): which units (GPUs, optionally their
//! MIG devices) this node publishes as shared, the capacities and request policies they carry,
//! and whether a share the scheduler allocated is one this node can give.
//!
//! A shared unit is one DRA device with `allowMultipleAllocations: true` and two consumable
//! capacities: `memory` (its bytes) and `compute` (percent of its SMs, 100 in all). Each has a
//! `requestPolicy` whose default is the whole unit, so a claim that asks for no capacity (every
//! pod spec written for whole GPUs) still gets the whole GPU; a claim asks for a share with
//! `capacity.requests: {memory: 20Gi, compute: "30"}` and the scheduler rounds each up to its
//! step. The valid values are `step, 2*step, ...` up to the largest multiple of the step not
//! above the unit's value, which is what the API server's validation of a `validRange` asks
//! for (default and max on the grid from min).
//!
//! The node never trusts the request: it reads `consumedCapacity` from the allocation result
//! and checks it against the same policy ([`UnitShares::check`]) before holding it.

use crate::gpu_select::{GpuSelect, InvalidField};
use crate::inventory::{DeviceRef, DeviceUuid, Gpu, Inventory};
use crate::quantity::{Format, Quantity};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

/// The consumable capacity holding a share's memory, in bytes (NVIDIA's capacity name).
pub const MEMORY: &str = "memory";
/// The consumable capacity holding a share's compute, in percent of the unit's SMs.
pub const COMPUTE: &str = "compute";
/// A whole unit's compute, in percent.
pub const WHOLE_COMPUTE: u32 = 100;

/// How a unit's shares run on the node (the config's `enforcement`, a name kept for
/// compatibility: neither mode enforces limits a container cannot undo, see
/// `dra::status::add_share`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
pub enum Enforcement {
    /// An MPS control daemon per shared unit; each container gets its memory and compute
    /// limits as MPS client settings in its environment (cooperative).
    #[serde(rename = "MPS")]
    Mps,
    /// The GPU is time-sliced among its shares; the limits are scheduling figures only.
    TimeSlicing,
}

impl fmt::Display for Enforcement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Enforcement::Mps => "MPS",
            Enforcement::TimeSlicing => "TimeSlicing",
        })
    }
}

/// The validated `sharing.consumableCapacity` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareConfig {
    /// Which GPUs share (those dynamic MIG partitions never do: [`crate::config::check_shared_and_dynamic`]).
    pub select: GpuSelect,
    /// Share the MIG devices of the chosen GPUs too (each with its own memory and SMs).
    pub mig_devices: bool,
    /// Bytes; the smallest share and the step between shares.
    pub memory_step: u64,
    /// Percent; divides 100.
    pub compute_step: u32,
    pub enforcement: Enforcement,
}

impl ShareConfig {
    /// The section's defaults: every GPU, 1Gi and 5% steps, MPS.
    pub fn defaults() -> ShareConfig {
        ShareConfig {
            select: GpuSelect::All,
            mig_devices: false,
            memory_step: DEFAULT_MEMORY_STEP,
            compute_step: DEFAULT_COMPUTE_STEP,
            enforcement: Enforcement::Mps,
        }
    }

    /// The sharing a node gets: its config's section, unless the node's switch (the
    /// `gpuplane.dev/sharing` label) says `off` (none) or `on` (the section, or the defaults
    /// where the config has none).
    pub fn for_node(config: Option<ShareConfig>, switch: Option<bool>) -> Option<ShareConfig> {
        match switch {
            None => config,
            Some(false) => None,
            Some(true) => Some(config.unwrap_or_else(ShareConfig::defaults)),
        }
    }

    pub fn shares_gpu(&self, g: &Gpu) -> bool {
        self.select.selects(g)
    }
}

/// What one shared unit offers: its memory and the steps its shares come in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitShares {
    /// The unit's memory in bytes (the capacity's value).
    pub memory: u64,
    pub memory_step: u64,
    pub compute_step: u32,
    /// How this unit's shares are enforced (the shell downgrades MPS to time-slicing where
    /// the MPS control program is missing).
    pub enforcement: Enforcement,
}

/// A share: what one allocation of a shared unit consumes.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, Deserialize,
)]
pub struct Share {
    /// Bytes.
    pub memory: u64,
    /// Percent of the unit's SMs.
    pub compute: u32,
}

impl fmt::Display for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} memory, {}% compute",
            Quantity::from_u64(self.memory, Format::BinarySI),
            self.compute
        )
    }
}

/// A share that is not one this unit gives.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShareError {
    #[error("consumedCapacity has no `{0}`")]
    Missing(&'static str),
    #[error("consumedCapacity `{name}` is {value:?}: {reason}")]
    Invalid {
        name: &'static str,
        value: String,
        reason: String,
    },
}

impl UnitShares {
    /// The largest valid memory share: the whole grid below the unit's memory.
    pub fn max_memory(&self) -> u64 {
        self.memory / self.memory_step.max(1) * self.memory_step
    }

    /// Whether `share` is a value the published policy allows (the scheduler only allocates
    /// such; anything else is a stale or forged allocation).
    pub fn check(&self, share: &Share) -> Result<(), ShareError> {
        let step = self.memory_step.max(1);
        if share.memory < step
            || share.memory > self.max_memory()
            || !share.memory.is_multiple_of(step)
        {
            return Err(ShareError::Invalid {
                name: MEMORY,
                value: Quantity::from_u64(share.memory, Format::BinarySI).to_string(),
                reason: format!(
                    "this device's shares are multiples of {} up to {}",
                    Quantity::from_u64(step, Format::BinarySI),
                    Quantity::from_u64(self.max_memory(), Format::BinarySI)
                ),
            });
        }
        let cstep = self.compute_step.max(1);
        if share.compute < cstep
            || share.compute > WHOLE_COMPUTE
            || !share.compute.is_multiple_of(cstep)
        {
            return Err(ShareError::Invalid {
                name: COMPUTE,
                value: share.compute.to_string(),
                reason: format!(
                    "this device's compute shares are multiples of {cstep} up to {WHOLE_COMPUTE}"
                ),
            });
        }
        Ok(())
    }

    /// The whole unit as a share (what a claim that asks for no capacity consumes).
    pub fn whole(&self) -> Share {
        Share {
            memory: self.max_memory(),
            compute: WHOLE_COMPUTE,
        }
    }
}

/// Reads a share from an allocation result's `consumedCapacity`.
pub fn share_from_consumed(
    consumed: &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
) -> Result<Share, ShareError> {
    let read = |name: &'static str| -> Result<u64, ShareError> {
        let q = consumed.get(name).ok_or(ShareError::Missing(name))?;
        let bad = |reason: &str| ShareError::Invalid {
            name,
            value: q.0.clone(),
            reason: reason.to_string(),
        };
        let parsed = Quantity::parse_trimmed(&q.0).map_err(|e| bad(&e.to_string()))?;
        if !parsed.is_integer() || parsed.is_negative() {
            return Err(bad("not a whole, non-negative number"));
        }
        parsed
            .value()
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(|| bad("out of range"))
    };
    let memory = read(MEMORY)?;
    let compute = u32::try_from(read(COMPUTE)?).map_err(|_| ShareError::Invalid {
        name: COMPUTE,
        value: consumed
            .get(COMPUTE)
            .map(|q| q.0.clone())
            .unwrap_or_default(),
        reason: "out of range".into(),
    })?;
    Ok(Share { memory, compute })
}

/// MPS client variable naming the control daemon's pipe directory.
pub const ENV_MPS_PIPE: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// CUDA's MPS client variable for the active thread percentage.
pub const ENV_MPS_THREADS: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// CUDA's MPS client variable for pinned device memory limits.
pub const ENV_MPS_PINNED: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// What the container's share is and how it is enforced, for its processes and for people.
pub const ENV_SHARE_MEMORY: &str = "GPUPLANE_SHARE_MEMORY";
pub const ENV_SHARE_COMPUTE: &str = "GPUPLANE_SHARE_COMPUTE";
pub const ENV_SHARE_ENFORCEMENT: &str = "GPUPLANE_SHARE_ENFORCEMENT";

/// The environment a container holding `share` gets. Under MPS: the daemon's pipe directory
/// and CUDA's MPS client limits (NVIDIA's MPS documentation: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
/// in percent, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` as `<ordinal>=<n>M`; the share is the claim's
/// only device, so its ordinal is 0). Always: the share and its enforcement, as `GPUPLANE_*`.
pub fn share_env(share: &Share, enforcement: Enforcement, pipe_dir: Option<&str>) -> Vec<String> {
    let mut env = vec![
        format!(
            "{ENV_SHARE_MEMORY}={}",
            Quantity::from_u64(share.memory, Format::BinarySI)
        ),
        format!("{ENV_SHARE_COMPUTE}={}", share.compute),
        format!("{ENV_SHARE_ENFORCEMENT}={enforcement}"),
    ];
    if let (Enforcement::Mps, Some(dir)) = (enforcement, pipe_dir) {
        env.push(format!("{ENV_MPS_PIPE}={dir}"));
        env.push(format!("{ENV_MPS_THREADS}={}", share.compute));
        env.push(format!("{ENV_MPS_PINNED}=0={}M", share.memory >> 20));
    }
    env
}

/// Every shared unit of `inv` and what it offers; empty when sharing is off.
pub fn shared_units(
    inv: &Inventory,
    cfg: Option<&ShareConfig>,
) -> BTreeMap<DeviceUuid, UnitShares> {
    let Some(cfg) = cfg else {
        return BTreeMap::new();
    };
    let unit = |mib: u64| UnitShares {
        memory: mib.saturating_mul(1 << 20),
        memory_step: cfg.memory_step,
        compute_step: cfg.compute_step,
        enforcement: cfg.enforcement,
    };
    inv.dra_devices()
        .into_iter()
        .filter_map(|d| match d {
            DeviceRef::Gpu(g) if cfg.shares_gpu(g) => Some((g.uuid.clone(), unit(g.memory_mib))),
            DeviceRef::Mig { parent, mig } if cfg.mig_devices && cfg.shares_gpu(parent) => {
                Some((mig.uuid.clone(), unit(mig.memory_mib)))
            }
            _ => None,
        })
        // A unit smaller than one step cannot be shared: it is published whole.
        .filter(|(_, u)| u.memory >= u.memory_step.saturating_mul(2))
        .collect()
}

/// The raw `sharing.consumableCapacity` section of the agent config.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct RawShares {
    #[serde(default)]
    gpus: Option<serde_yaml_ng::Value>,
    #[serde(default)]
    models: Option<Vec<String>>,
    #[serde(default)]
    mig_devices: bool,
    #[serde(default)]
    memory_step: Option<String>,
    #[serde(default)]
    compute_step: Option<u32>,
    #[serde(default)]
    enforcement: Option<Enforcement>,
}

const SECTION: &str = "sharing.consumableCapacity";
const DEFAULT_MEMORY_STEP: u64 = 1 << 30;
const DEFAULT_COMPUTE_STEP: u32 = 5;

impl RawShares {
    /// Validates the section; errors name the field under [`SECTION`].
    pub(crate) fn validate(self) -> Result<ShareConfig, InvalidField> {
        let bad = |field: &str, reason: String| InvalidField::new(SECTION, field, reason);
        let select = GpuSelect::parse(
            SECTION,
            self.gpus,
            self.models,
            "remove the section to share nothing",
        )?;
        let memory_step = match self.memory_step {
            None => DEFAULT_MEMORY_STEP,
            Some(s) => Quantity::parse_trimmed(&s)
                .ok()
                .filter(|q| q.is_integer() && !q.is_negative() && !q.is_zero())
                .and_then(|q| q.value())
                .and_then(|v| u64::try_from(v).ok())
                .filter(|v| *v >= 1 << 20)
                .ok_or_else(|| {
                    bad(
                        "memoryStep",
                        format!("`{s}` is not a size of at least 1Mi like 1Gi"),
                    )
                })?,
        };
        let compute_step = self.compute_step.unwrap_or(DEFAULT_COMPUTE_STEP);
        if compute_step == 0 || !WHOLE_COMPUTE.is_multiple_of(compute_step) {
            return Err(bad(
                "computeStep",
                format!("{compute_step} does not divide 100; use e.g. 1, 5, 10 or 25"),
            ));
        }
        Ok(ShareConfig {
            select,
            mig_devices: self.mig_devices,
            memory_step,
            compute_step,
            enforcement: self.enforcement.unwrap_or(Enforcement::Mps),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn unit() -> UnitShares {
        UnitShares {
            memory: 81920 << 20,
            memory_step: 1 << 30,
            compute_step: 10,
            enforcement: Enforcement::Mps,
        }
    }

    #[test]
    fn shares_on_the_grid_are_valid_and_others_are_named() {
        let u = unit();
        u.check(&Share {
            memory: 40 << 30,
            compute: 50,
        })
        .unwrap();
        u.check(&u.whole()).unwrap();
        let e = u
            .check(&Share {
                memory: 81 << 30,
                compute: 50,
            })
            .unwrap_err();
        assert!(e.to_string().contains("multiples of 1Gi up to 80Gi"), "{e}");
        assert!(u
            .check(&Share {
                memory: 1 << 30,
                compute: 55
            })
            .is_err());
        assert!(u
            .check(&Share {
                memory: 0,
                compute: 10
            })
            .is_err());
    }

    #[test]
    fn a_unit_not_on_the_grid_offers_its_largest_multiple() {
        let u = UnitShares {
            memory: 81559 << 20,
            ..unit()
        };
        assert_eq!(u.max_memory(), 79 << 30);
    }

    #[test]
    fn consumed_capacity_is_read_exactly() {
        let q = |s: &str| k8s_openapi::apimachinery::pkg::api::resource::Quantity(s.into());
        let m = BTreeMap::from([
            ("memory".to_string(), q("40Gi")),
            ("compute".to_string(), q("50")),
        ]);
        assert_eq!(
            share_from_consumed(&m).unwrap(),
            Share {
                memory: 40 << 30,
                compute: 50
            }
        );
        let m = BTreeMap::from([("memory".to_string(), q("40Gi"))]);
        assert_eq!(share_from_consumed(&m), Err(ShareError::Missing(COMPUTE)));
        let m = BTreeMap::from([
            ("memory".to_string(), q("1.5")),
            ("compute".to_string(), q("5")),
        ]);
        assert!(share_from_consumed(&m).is_err());
    }

    #[test]
    fn the_node_switch_overrides_the_section() {
        let section = ShareConfig {
            compute_step: 10,
            ..ShareConfig::defaults()
        };
        assert_eq!(
            ShareConfig::for_node(Some(section.clone()), None),
            Some(section.clone())
        );
        assert_eq!(
            ShareConfig::for_node(Some(section.clone()), Some(false)),
            None
        );
        assert_eq!(
            ShareConfig::for_node(Some(section.clone()), Some(true)),
            Some(section)
        );
        assert_eq!(
            ShareConfig::for_node(None, Some(true)),
            Some(ShareConfig::defaults())
        );
        assert_eq!(ShareConfig::for_node(None, None), None);
    }

    #[test]
    fn the_section_is_validated_naming_its_fields() {
        let parse = |y: &str| serde_yaml_ng::from_str::<RawShares>(y).unwrap().validate();
        let c = parse("gpus: [0, 2]\nmemoryStep: 2Gi\ncomputeStep: 10").unwrap();
        assert_eq!(c.select, GpuSelect::Indices(BTreeSet::from([0, 2])));
        assert_eq!((c.memory_step, c.compute_step), (2 << 30, 10));
        assert_eq!(parse("gpus: all").unwrap().select, GpuSelect::All);
        for (y, field) in [
            ("computeStep: 30", "computeStep"),
            ("memoryStep: 1k", "memoryStep"),
            ("gpus: two", "gpus"),
            ("gpus: [0]\nmodels: [x]", "gpus"),
        ] {
            let e = parse(y).unwrap_err();
            assert_eq!(e.field, format!("{SECTION}.{field}"), "{y}: {e}");
        }
    }
}
