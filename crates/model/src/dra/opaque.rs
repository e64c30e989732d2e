//! The opaque device configuration a ResourceClaim (or its DeviceClass) carries for gpuplane:
//! `opaque.parameters` of a config whose `opaque.driver` is our driver name.
//!
//! ```yaml
//! apiVersion: gpu.gpuplane.dev/v1alpha1
//! kind: GpuConfig
//! sharing:
//!   strategy: MPS                      # or TimeSlicing
//!   mpsConfig:
//!     defaultActiveThreadPercentage: 50          # 1..=100
//!     defaultPinnedDeviceMemoryLimit: 10Gi       # a Kubernetes quantity, at least 1Mi
//!     defaultPerDevicePinnedMemoryLimit:         # by DRA device name or unit UUID
//!       gpu-3: 4Gi
//! # or
//! sharing:
//!   strategy: TimeSlicing
//!   timeSlicingConfig:
//!     interval: Default                # Default | Short | Medium | Long
//! ```
//!
//! Field names follow NVIDIA's `resource.nvidia.com/v1beta1` `GpuConfig` (`sharing.go`:
//! `strategy`, `timeSlicingConfig.interval`, `mpsConfig.defaultActiveThreadPercentage`,
//! `mpsConfig.defaultPinnedDeviceMemoryLimit`, `mpsConfig.defaultPerDevicePinnedMemoryLimit`), so
//! a config written for NVIDIA's driver is accepted as written, under its own apiVersion
//! [`NVIDIA_API_VERSION`]. The shorter
//! spellings `timeSlicing` and `mps` are accepted as aliases (giving both is an error).
//!
//! Decoding is strict: an unknown field, apiVersion, kind, strategy or interval, a value of the
//! wrong type or out of range, or a sub-config that does not belong to the chosen strategy is an
//! error that names the field by its path (`sharing.mpsConfig.defaultActiveThreadPercentage`).
//! `null` counts as absent, as in Kubernetes' own decoding.
//!
//! # What a config does, honestly
//!
//! gpuplane does not (yet) run an MPS control daemon, and it cannot change a GPU's time-slice in
//! simulation. A config therefore only turns into environment variables on the claim's CDI
//! devices ([`container_env`]):
//!
//! - always `GPUPLANE_SHARING_STRATEGY=TimeSlicing|MPS`;
//! - time-slicing: `GPUPLANE_TIMESLICE_INTERVAL=<interval>`, a record of what was asked for. The
//!   GPU's scheduler keeps its own time-slice (NVIDIA's driver sets it with
//!   `nvidia-smi compute-policy --set-timeslice`; we do not). A non-`Default` interval on a MIG
//!   device is refused: MIG devices have no settable time-slice. A CDI annotation would be the
//!   natural place for the note, but annotations need cdiVersion 0.6.0 and podman 4.3 reads at
//!   most 0.5.0, so it is an environment variable;
//! - MPS: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<n>` and
//!   `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<ordinal>=<MiB>M,...`. These are the CUDA client-side MPS
//!   variables: they take effect only when the container's CUDA processes connect to an MPS
//!   server, which gpuplane does not start. The ordinals are positions of the devices within the
//!   config's device group, ordered by PCI bus id and then DRA device name; they match CUDA's
//!   ordinals when the container sees exactly those devices in that order
//!   (`CUDA_DEVICE_ORDER=PCI_BUS_ID`).
//!
//! The variables are set per CDI device; when one container gets devices from two requests
//! with different configs, the runtime's merge of the clashing variables decides (last wins).

use crate::quantity::{Quantity, QuantityError};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;

/// The apiVersion of gpuplane's opaque config.
pub const API_VERSION: &str = "gpu.gpuplane.dev/v1alpha1";

/// NVIDIA's DRA driver's apiVersion for the same `GpuConfig`: accepted as written, so claims
/// made for NVIDIA's driver keep working when gpuplane replaces it (`--driver-name gpu.nvidia.com`).
pub const NVIDIA_API_VERSION: &str = "resource.nvidia.com/v1beta1";
/// The only kind there is.
pub const KIND: &str = "GpuConfig";

/// Environment variable recording the sharing strategy.
pub const ENV_STRATEGY: &str = "GPUPLANE_SHARING_STRATEGY";
/// Environment variable recording the requested time-slice interval.
pub const ENV_TIMESLICE: &str = "GPUPLANE_TIMESLICE_INTERVAL";
/// CUDA's MPS client variable for the active thread percentage.
pub const ENV_MPS_THREADS: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// CUDA's MPS client variable for pinned device memory limits.
pub const ENV_MPS_PINNED: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";

/// Why an opaque config was rejected. Every variant names the field by its path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpaqueError {
    #[error("{field}: expected {expected}, got {got}")]
    WrongType {
        field: String,
        expected: &'static str,
        got: &'static str,
    },
    #[error("{field}: required")]
    Missing { field: String },
    #[error("{field}: unknown field (allowed: {allowed})")]
    UnknownField { field: String, allowed: String },
    #[error("{field}: give either `{a}` or `{b}`, not both")]
    Both {
        field: String,
        a: &'static str,
        b: &'static str,
    },
    #[error("apiVersion: `{found}` is not supported (expected `{API_VERSION}` or NVIDIA's `{NVIDIA_API_VERSION}`)")]
    ApiVersion { found: String },
    #[error("kind: `{found}` is not supported (expected `{KIND}`)")]
    Kind { found: String },
    #[error("{field}: `{value}` is not one of {allowed}")]
    NotOneOf {
        field: String,
        value: String,
        allowed: &'static str,
    },
    #[error("{field}: {value} is out of range ({range})")]
    OutOfRange {
        field: String,
        value: String,
        range: &'static str,
    },
    #[error("{field}: `{value}` is not a valid quantity: {reason}")]
    Quantity {
        field: String,
        value: String,
        // Boxed: this enum travels inside the DRA core's error, which clippy keeps small.
        reason: Box<QuantityError>,
    },
    #[error("{field}: not allowed with strategy {strategy}")]
    NotWithStrategy {
        field: String,
        strategy: &'static str,
    },
    #[error("{field}: `{key}` is not one of the devices this config applies to ({devices})")]
    UnknownDevice {
        field: String,
        key: String,
        devices: String,
    },
    #[error("{field}: interval {interval} cannot be set on MIG device {device} (MIG devices have no settable time-slice)")]
    IntervalOnMig {
        field: String,
        interval: TimeSliceInterval,
        device: String,
    },
}

/// A decoded `GpuConfig`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuConfig {
    /// `None`: no sharing settings (the device is used as allocated).
    pub sharing: Option<Sharing>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sharing {
    TimeSlicing(TimeSlicingConfig),
    Mps(MpsConfig),
}

impl Sharing {
    /// The strategy's name as written in the config.
    pub fn strategy(&self) -> &'static str {
        match self {
            Sharing::TimeSlicing(_) => STRATEGY_TIME_SLICING,
            Sharing::Mps(_) => STRATEGY_MPS,
        }
    }
}

const STRATEGY_TIME_SLICING: &str = "TimeSlicing";
const STRATEGY_MPS: &str = "MPS";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TimeSlicingConfig {
    pub interval: TimeSliceInterval,
}

/// NVIDIA's named time-slice lengths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum TimeSliceInterval {
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

impl TimeSliceInterval {
    pub fn as_str(self) -> &'static str {
        match self {
            TimeSliceInterval::Default => "Default",
            TimeSliceInterval::Short => "Short",
            TimeSliceInterval::Medium => "Medium",
            TimeSliceInterval::Long => "Long",
        }
    }
}

impl fmt::Display for TimeSliceInterval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MpsConfig {
    /// 1..=100.
    pub default_active_thread_percentage: Option<u8>,
    /// Applied to every device of the config.
    pub default_pinned_device_memory_limit: Option<MemoryLimit>,
    /// Overrides per device, keyed by DRA device name or unit UUID.
    pub default_per_device_pinned_memory_limit: BTreeMap<String, MemoryLimit>,
}

/// A memory limit: the quantity as written and its value in bytes (rounded up, as
/// Kubernetes' `Value()` rounds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLimit {
    pub quantity: String,
    pub bytes: u64,
}

impl MemoryLimit {
    /// Whole MiB, rounded down, as NVIDIA's driver hands them to MPS (`<n>M`).
    pub fn mebibytes(&self) -> u64 {
        self.bytes / (1024 * 1024)
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn as_object<'a>(v: &'a Value, field: &str) -> Result<&'a Map<String, Value>, OpaqueError> {
    v.as_object().ok_or_else(|| OpaqueError::WrongType {
        field: if field.is_empty() {
            "parameters".into()
        } else {
            field.into()
        },
        expected: "an object",
        got: type_name(v),
    })
}

/// Rejects keys outside `allowed`.
fn only(map: &Map<String, Value>, path: &str, allowed: &[&str]) -> Result<(), OpaqueError> {
    match map.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(OpaqueError::UnknownField {
            field: join(path, k),
            allowed: allowed.join(", "),
        }),
        None => Ok(()),
    }
}

/// The value of `key` (or its alias), `None` when absent or null.
fn get<'a>(
    map: &'a Map<String, Value>,
    path: &str,
    key: &'static str,
    alias: Option<&'static str>,
) -> Result<Option<(&'a Value, String)>, OpaqueError> {
    let present = |k: &str| map.get(k).filter(|v| !v.is_null());
    let main = present(key);
    let other = alias.and_then(|a| present(a).map(|v| (v, a)));
    match (main, other) {
        (Some(_), Some((_, a))) => Err(OpaqueError::Both {
            field: path.to_string(),
            a: key,
            b: a,
        }),
        (Some(v), None) => Ok(Some((v, join(path, key)))),
        (None, Some((v, a))) => Ok(Some((v, join(path, a)))),
        (None, None) => Ok(None),
    }
}

fn string<'a>(v: &'a Value, field: &str) -> Result<&'a str, OpaqueError> {
    v.as_str().ok_or_else(|| OpaqueError::WrongType {
        field: field.to_string(),
        expected: "a string",
        got: type_name(v),
    })
}

/// Decodes `opaque.parameters`.
pub fn parse(raw: &Value) -> Result<GpuConfig, OpaqueError> {
    let top = as_object(raw, "")?;
    only(top, "", &["apiVersion", "kind", "sharing"])?;
    let api_version = get(top, "", "apiVersion", None)?.ok_or_else(|| OpaqueError::Missing {
        field: "apiVersion".into(),
    })?;
    let api_version = string(api_version.0, &api_version.1)?;
    if api_version != API_VERSION && api_version != NVIDIA_API_VERSION {
        return Err(OpaqueError::ApiVersion {
            found: api_version.to_string(),
        });
    }
    let kind = get(top, "", "kind", None)?.ok_or_else(|| OpaqueError::Missing {
        field: "kind".into(),
    })?;
    let kind = string(kind.0, &kind.1)?;
    if kind != KIND {
        return Err(OpaqueError::Kind {
            found: kind.to_string(),
        });
    }
    let sharing = match get(top, "", "sharing", None)? {
        Some((v, path)) => Some(parse_sharing(v, &path)?),
        None => None,
    };
    Ok(GpuConfig { sharing })
}

const TIME_SLICING_KEY: &str = "timeSlicingConfig";
const TIME_SLICING_ALIAS: &str = "timeSlicing";
const MPS_KEY: &str = "mpsConfig";
const MPS_ALIAS: &str = "mps";

fn parse_sharing(v: &Value, path: &str) -> Result<Sharing, OpaqueError> {
    let map = as_object(v, path)?;
    only(
        map,
        path,
        &[
            "strategy",
            TIME_SLICING_KEY,
            TIME_SLICING_ALIAS,
            MPS_KEY,
            MPS_ALIAS,
        ],
    )?;
    let strategy = get(map, path, "strategy", None)?.ok_or_else(|| OpaqueError::Missing {
        field: join(path, "strategy"),
    })?;
    let strategy_str = string(strategy.0, &strategy.1)?;
    let ts = get(map, path, TIME_SLICING_KEY, Some(TIME_SLICING_ALIAS))?;
    let mps = get(map, path, MPS_KEY, Some(MPS_ALIAS))?;
    match strategy_str {
        STRATEGY_TIME_SLICING => {
            if let Some((_, field)) = mps {
                return Err(OpaqueError::NotWithStrategy {
                    field,
                    strategy: STRATEGY_TIME_SLICING,
                });
            }
            let config = match ts {
                Some((v, field)) => parse_time_slicing(v, &field)?,
                None => TimeSlicingConfig::default(),
            };
            Ok(Sharing::TimeSlicing(config))
        }
        STRATEGY_MPS => {
            if let Some((_, field)) = ts {
                return Err(OpaqueError::NotWithStrategy {
                    field,
                    strategy: STRATEGY_MPS,
                });
            }
            let config = match mps {
                Some((v, field)) => parse_mps(v, &field)?,
                None => MpsConfig::default(),
            };
            Ok(Sharing::Mps(config))
        }
        other => Err(OpaqueError::NotOneOf {
            field: strategy.1,
            value: other.to_string(),
            allowed: "TimeSlicing, MPS",
        }),
    }
}

fn parse_time_slicing(v: &Value, path: &str) -> Result<TimeSlicingConfig, OpaqueError> {
    let map = as_object(v, path)?;
    only(map, path, &["interval"])?;
    let interval = match get(map, path, "interval", None)? {
        None => TimeSliceInterval::Default,
        Some((v, field)) => match string(v, &field)? {
            "Default" => TimeSliceInterval::Default,
            "Short" => TimeSliceInterval::Short,
            "Medium" => TimeSliceInterval::Medium,
            "Long" => TimeSliceInterval::Long,
            other => {
                return Err(OpaqueError::NotOneOf {
                    field,
                    value: other.to_string(),
                    allowed: "Default, Short, Medium, Long",
                })
            }
        },
    };
    Ok(TimeSlicingConfig { interval })
}

const THREADS_KEY: &str = "defaultActiveThreadPercentage";
const PINNED_KEY: &str = "defaultPinnedDeviceMemoryLimit";
const PER_DEVICE_KEY: &str = "defaultPerDevicePinnedMemoryLimit";

fn parse_mps(v: &Value, path: &str) -> Result<MpsConfig, OpaqueError> {
    let map = as_object(v, path)?;
    only(map, path, &[THREADS_KEY, PINNED_KEY, PER_DEVICE_KEY])?;
    let mut out = MpsConfig::default();
    if let Some((v, field)) = get(map, path, THREADS_KEY, None)? {
        let n = match v {
            Value::Number(n) => n,
            other => {
                return Err(OpaqueError::WrongType {
                    field,
                    expected: "an integer",
                    got: type_name(other),
                });
            }
        };
        match n.as_u64().filter(|p| (1..=100).contains(p)) {
            Some(p) => out.default_active_thread_percentage = u8::try_from(p).ok(),
            None => {
                return Err(OpaqueError::OutOfRange {
                    field,
                    value: n.to_string(),
                    range: "an integer from 1 to 100",
                })
            }
        }
    }
    if let Some((v, field)) = get(map, path, PINNED_KEY, None)? {
        out.default_pinned_device_memory_limit = Some(memory_limit(v, &field)?);
    }
    if let Some((v, field)) = get(map, path, PER_DEVICE_KEY, None)? {
        let per = as_object(v, &field)?;
        for (key, limit) in per {
            let entry_field = format!("{field}.{key}");
            if key.is_empty() {
                return Err(OpaqueError::NotOneOf {
                    field: entry_field,
                    value: String::new(),
                    allowed: "a DRA device name or a unit UUID",
                });
            }
            out.default_per_device_pinned_memory_limit
                .insert(key.clone(), memory_limit(limit, &entry_field)?);
        }
    }
    Ok(out)
}

fn memory_limit(v: &Value, field: &str) -> Result<MemoryLimit, OpaqueError> {
    let text = match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        other => {
            return Err(OpaqueError::WrongType {
                field: field.to_string(),
                expected: "a quantity (string or number)",
                got: type_name(other),
            })
        }
    };
    // Trimmed as Kubernetes' JSON decoding trims a quantity.
    let q = Quantity::parse_trimmed(&text).map_err(|reason| OpaqueError::Quantity {
        field: field.to_string(),
        value: text.clone(),
        reason: Box::new(reason),
    })?;
    let out_of_range = |range| OpaqueError::OutOfRange {
        field: field.to_string(),
        value: text.clone(),
        range,
    };
    if q.is_negative() {
        return Err(out_of_range("at least 1Mi"));
    }
    let bytes = q
        .value()
        .and_then(|v| u64::try_from(v).ok())
        .ok_or_else(|| out_of_range("at most 2^63-1 bytes"))?;
    let limit = MemoryLimit {
        quantity: text.clone(),
        bytes,
    };
    if limit.mebibytes() == 0 {
        return Err(out_of_range("at least 1Mi"));
    }
    Ok(limit)
}

/// A device a config applies to, for [`container_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfiguredDevice {
    /// DRA device name.
    pub name: String,
    /// Unit UUID (GPU or MIG).
    pub uuid: String,
    /// PCI bus id of the (parent) GPU, for ordering.
    pub pci_bus_id: String,
    pub is_mig: bool,
}

/// The environment each CDI device of `devices` (the devices `config` applies to within one
/// claim) gets, one `NAME=value` per entry. Checks what can only be checked against devices:
/// per-device limit keys must name one of them, and time-slice intervals do not apply to MIG.
pub fn container_env(
    config: &GpuConfig,
    devices: &[ConfiguredDevice],
) -> Result<Vec<String>, OpaqueError> {
    let Some(sharing) = &config.sharing else {
        return Ok(Vec::new());
    };
    let mut env = vec![format!("{ENV_STRATEGY}={}", sharing.strategy())];
    match sharing {
        Sharing::TimeSlicing(ts) => {
            if ts.interval != TimeSliceInterval::Default {
                if let Some(mig) = devices.iter().find(|d| d.is_mig) {
                    return Err(OpaqueError::IntervalOnMig {
                        field: format!("sharing.{TIME_SLICING_KEY}.interval"),
                        interval: ts.interval,
                        device: mig.name.clone(),
                    });
                }
            }
            env.push(format!("{ENV_TIMESLICE}={}", ts.interval));
        }
        Sharing::Mps(mps) => {
            if let Some(p) = mps.default_active_thread_percentage {
                env.push(format!("{ENV_MPS_THREADS}={p}"));
            }
            let mut ordered: Vec<&ConfiguredDevice> = devices.iter().collect();
            ordered.sort_by(|a, b| (&a.pci_bus_id, &a.name).cmp(&(&b.pci_bus_id, &b.name)));
            let mut limits: Vec<Option<u64>> = vec![
                mps.default_pinned_device_memory_limit
                    .as_ref()
                    .map(MemoryLimit::mebibytes);
                ordered.len()
            ];
            for (key, limit) in &mps.default_per_device_pinned_memory_limit {
                let Some(i) = ordered
                    .iter()
                    .position(|d| &d.name == key || &d.uuid == key)
                else {
                    return Err(OpaqueError::UnknownDevice {
                        field: format!("sharing.{MPS_KEY}.{PER_DEVICE_KEY}"),
                        key: key.clone(),
                        devices: ordered
                            .iter()
                            .map(|d| d.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                };
                limits[i] = Some(limit.mebibytes());
            }
            let list: Vec<String> = limits
                .iter()
                .enumerate()
                .filter_map(|(i, l)| l.map(|mib| format!("{i}={mib}M")))
                .collect();
            if !list.is_empty() {
                env.push(format!("{ENV_MPS_PINNED}={}", list.join(",")));
            }
        }
    }
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base(sharing: Value) -> Value {
        json!({"apiVersion": API_VERSION, "kind": KIND, "sharing": sharing})
    }

    fn err(v: Value) -> String {
        parse(&v).unwrap_err().to_string()
    }

    fn dev(name: &str, bus: &str, mig: bool) -> ConfiguredDevice {
        ConfiguredDevice {
            name: name.into(),
            uuid: format!("GPU-{name}"),
            pci_bus_id: bus.into(),
            is_mig: mig,
        }
    }

    #[test]
    fn nvidia_configs_are_accepted_as_written() {
        let c = parse(&json!({
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
        }))
        .unwrap();
        assert_eq!(c.sharing.map(|s| s.strategy()), Some("TimeSlicing"));
        let e = parse(&json!({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("resource.nvidia.com/v1beta1"), "{e}");
    }

    #[test]
    fn decodes_both_strategies_and_no_sharing() {
        assert_eq!(
            parse(&json!({"apiVersion": API_VERSION, "kind": KIND})).unwrap(),
            GpuConfig::default()
        );
        let ts = parse(&base(
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
        ))
        .unwrap();
        assert_eq!(
            ts.sharing,
            Some(Sharing::TimeSlicing(TimeSlicingConfig {
                interval: TimeSliceInterval::Long
            }))
        );
        let ts = parse(&base(
            json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}}),
        ))
        .unwrap();
        assert_eq!(
            ts.sharing,
            Some(Sharing::TimeSlicing(TimeSlicingConfig {
                interval: TimeSliceInterval::Short
            }))
        );
        let ts = parse(&base(json!({"strategy": "TimeSlicing"}))).unwrap();
        assert_eq!(
            ts.sharing,
            Some(Sharing::TimeSlicing(TimeSlicingConfig::default()))
        );

        let mps = parse(&base(json!({"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "10Gi",
            "defaultPerDevicePinnedMemoryLimit": {"gpu-3": "512Mi"}}})))
        .unwrap();
        let Some(Sharing::Mps(m)) = mps.sharing else {
            panic!("not MPS")
        };
        assert_eq!(m.default_active_thread_percentage, Some(50));
        assert_eq!(
            m.default_pinned_device_memory_limit.unwrap().mebibytes(),
            10240
        );
        assert_eq!(
            m.default_per_device_pinned_memory_limit["gpu-3"].mebibytes(),
            512
        );
        let mps = parse(&base(
            json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": null}}),
        ))
        .unwrap();
        assert_eq!(mps.sharing, Some(Sharing::Mps(MpsConfig::default())));
    }

    #[test]
    fn strict_decoding_names_the_field() {
        let cases: Vec<(Value, &str)> = vec![
            (json!("x"), "parameters: expected an object"),
            (json!({"kind": KIND}), "apiVersion: required"),
            (json!({"apiVersion": API_VERSION}), "kind: required"),
            (json!({"apiVersion": "resource.nvidia.com/v1", "kind": KIND}), "apiVersion: `resource.nvidia.com/v1`"),
            (json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig"}), "kind: `MigDeviceConfig`"),
            (json!({"apiVersion": API_VERSION, "kind": KIND, "extra": 1}), "extra: unknown field"),
            (base(json!({"strategy": "Fabric"})), "sharing.strategy: `Fabric` is not one of"),
            (base(json!({"timeSlicingConfig": {}})), "sharing.strategy: required"),
            (base(json!({"strategy": 7})), "sharing.strategy: expected a string, got a number"),
            (base(json!({"strategy": "MPS", "foo": 1})), "sharing.foo: unknown field"),
            (base(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}})),
                "sharing.timeSlicingConfig.interval: `Forever`"),
            (base(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"intervall": "Long"}})),
                "sharing.timeSlicingConfig.intervall: unknown field"),
            (base(json!({"strategy": "TimeSlicing", "mpsConfig": {}})),
                "sharing.mpsConfig: not allowed with strategy TimeSlicing"),
            (base(json!({"strategy": "MPS", "timeSlicing": {}})), "sharing.timeSlicing: not allowed with strategy MPS"),
            (base(json!({"strategy": "MPS", "mps": {}, "mpsConfig": {}})), "sharing: give either `mpsConfig` or `mps`"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}})),
                "sharing.mpsConfig.defaultActiveThreadPercentage: 0 is out of range"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}})),
                "sharing.mpsConfig.defaultActiveThreadPercentage: 101 is out of range"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 2.5}})),
                "sharing.mpsConfig.defaultActiveThreadPercentage: 2.5 is out of range"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}})),
                "sharing.mpsConfig.defaultActiveThreadPercentage: expected an integer, got a string"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "10Gb"}})),
                "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: `10Gb` is not a valid quantity"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "-1Gi"}})),
                "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: -1Gi is out of range (at least 1Mi)"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1000E"}})),
                "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 1000E is out of range (at most 2^63-1 bytes)"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1Ki"}})),
                "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 1Ki is out of range (at least 1Mi)"),
            (base(json!({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"gpu-1": true}}})),
                "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.gpu-1: expected a quantity"),
        ];
        for (v, want) in cases {
            let got = err(v.clone());
            assert!(got.starts_with(want), "{v}: got `{got}`, want `{want}…`");
        }
    }

    #[test]
    fn memory_limits_read_kubernetes_quantities() {
        let bytes = |v: Value| memory_limit(&v, "f").map(|l| l.bytes);
        assert_eq!(bytes(json!("10Gi")), Ok(10 << 30));
        assert_eq!(bytes(json!("1.5Gi")), Ok(3 << 29));
        assert_eq!(bytes(json!("512M")), Ok(512_000_000));
        assert_eq!(bytes(json!("1e9")), Ok(1_000_000_000));
        assert_eq!(bytes(json!("1048576")), Ok(1 << 20));
        assert_eq!(bytes(json!("1048575500m")), Ok(1 << 20));
        assert_eq!(
            bytes(json!(".5Mi")),
            Err(OpaqueError::OutOfRange {
                field: "f".into(),
                value: ".5Mi".into(),
                range: "at least 1Mi",
            })
        );
        assert_eq!(bytes(json!(" 2Mi ")), Ok(2 << 20));
        for bad in [
            "",
            "Mi5",
            "1E+3k",
            "1..2",
            "1.2.3",
            "10GB",
            "1 Gi",
            "1e99999999999",
        ] {
            assert!(
                matches!(bytes(json!(bad)), Err(OpaqueError::Quantity { .. })),
                "{bad:?} accepted"
            );
        }
        let limit = memory_limit(&json!(1_073_741_824u64), "f").unwrap();
        assert_eq!(limit.mebibytes(), 1024);
    }

    #[test]
    fn env_for_time_slicing_and_mps() {
        let ts = parse(&base(
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}}),
        ))
        .unwrap();
        assert_eq!(
            container_env(&ts, &[dev("gpu-3", "0000:c1", false)]).unwrap(),
            vec![
                "GPUPLANE_SHARING_STRATEGY=TimeSlicing",
                "GPUPLANE_TIMESLICE_INTERVAL=Medium"
            ]
        );
        let e = container_env(&ts, &[dev("gpu-0-mig-1g5gb-9", "0000:01", true)]).unwrap_err();
        assert!(e.to_string().contains("gpu-0-mig-1g5gb-9"), "{e}");
        let default = parse(&base(json!({"strategy": "TimeSlicing"}))).unwrap();
        assert!(container_env(&default, &[dev("gpu-0-mig-1g5gb-9", "0000:01", true)]).is_ok());

        let mps = parse(&base(json!({"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 25,
            "defaultPinnedDeviceMemoryLimit": "1Gi",
            "defaultPerDevicePinnedMemoryLimit": {"GPU-b": "2Gi"}}})))
        .unwrap();
        let devs = [dev("b", "0000:81", false), dev("a", "0000:01", false)];
        assert_eq!(
            container_env(&mps, &devs).unwrap(),
            vec![
                "GPUPLANE_SHARING_STRATEGY=MPS",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M,1=2048M"
            ]
        );
        let e = container_env(&mps, &devs[1..]).unwrap_err();
        assert!(
            e.to_string().contains("`GPU-b` is not one of the devices"),
            "{e}"
        );
        assert!(container_env(&GpuConfig::default(), &devs)
            .unwrap()
            .is_empty());
    }
}
