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
//! A config may only call itself a sharing strategy when something on the node does what it
//! says ([`container_env`]):
//!
//! - time-slicing with interval `Default` (or none) is what a GPU does anyway when the pods of
//!   one claim share it: accepted, recorded as `GPUPLANE_SHARING_STRATEGY=TimeSlicing`;
//! - any other interval is refused at prepare. NVIDIA's driver sets it with
//!   `nvidia-smi compute-policy --set-timeslice`, a setting of the whole GPU that outlives the
//!   claim and that NVML does not offer; gpuplane changes no GPU setting for a claim;
//! - MPS is refused at prepare. Its CUDA client variables (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`,
//!   `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`) in a container "only further constrain the limit set
//!   by the control daemon" (NVIDIA's MPS documentation, "Environment Variables"): without a
//!   daemon they share and limit nothing. gpuplane runs MPS for the GPU shares it publishes
//!   (consumable capacity, [`crate::sharing`]), not for a config.
//!
//! The refusal names the field and what to do instead, and the kubelet reports it on the pod.

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
    #[error("{field}: {value} is not supported: {why}")]
    NotSupported {
        field: String,
        value: String,
        why: &'static str,
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

/// Why a time-slice interval other than `Default` is refused.
const WHY_NO_INTERVAL: &str = "gpuplane does not change a GPU's time slice (NVIDIA's driver \
    runs `nvidia-smi compute-policy --set-timeslice`, a setting of the whole GPU that outlives \
    the claim); leave the interval out or set it to Default";
/// Why MPS in a config is refused.
const WHY_NO_MPS: &str = "gpuplane runs no MPS control daemon for a config, and the CUDA MPS \
    variables alone limit nothing; for GPU shares under MPS, request a share of a GPU this node \
    publishes with capacity (docs/mig-and-sharing.md), or use strategy TimeSlicing to let the \
    pods of one claim take turns on its GPU";

/// The environment the devices a config applies to get, one `NAME=value` per entry, or the
/// refusal of a setting gpuplane would not carry out (module docs).
pub fn container_env(config: &GpuConfig) -> Result<Vec<String>, OpaqueError> {
    match &config.sharing {
        None => Ok(Vec::new()),
        Some(Sharing::TimeSlicing(ts)) if ts.interval != TimeSliceInterval::Default => {
            Err(OpaqueError::NotSupported {
                field: format!("sharing.{TIME_SLICING_KEY}.interval"),
                value: ts.interval.to_string(),
                why: WHY_NO_INTERVAL,
            })
        }
        Some(Sharing::TimeSlicing(_)) => {
            Ok(vec![format!("{ENV_STRATEGY}={STRATEGY_TIME_SLICING}")])
        }
        Some(Sharing::Mps(_)) => Err(OpaqueError::NotSupported {
            field: "sharing.strategy".into(),
            value: STRATEGY_MPS.into(),
            why: WHY_NO_MPS,
        }),
    }
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
    fn only_what_the_node_carries_out_becomes_env_the_rest_is_refused_by_field() {
        let default = parse(&base(json!({"strategy": "TimeSlicing"}))).unwrap();
        assert_eq!(
            container_env(&default).unwrap(),
            vec!["GPUPLANE_SHARING_STRATEGY=TimeSlicing"]
        );
        let ts = parse(&base(
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}}),
        ))
        .unwrap();
        let e = container_env(&ts).unwrap_err().to_string();
        assert!(
            e.starts_with("sharing.timeSlicingConfig.interval: Medium is not supported"),
            "{e}"
        );
        assert!(e.contains("set it to Default"), "{e}");
        let mps = parse(&base(json!({"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 25}})))
        .unwrap();
        let e = container_env(&mps).unwrap_err().to_string();
        assert!(
            e.starts_with("sharing.strategy: MPS is not supported"),
            "{e}"
        );
        assert!(e.contains("request a share"), "{e}");
        assert!(container_env(&GpuConfig::default()).unwrap().is_empty());
    }
}
