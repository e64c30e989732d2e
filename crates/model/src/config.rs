//! The agent's configuration file: what to serve and how, validated before use.
//!
//! The shape follows NVIDIA's k8s-device-plugin config (`version`, `flags`, `sharing`) so an
//! existing file keeps working, plus gpuplane's own sections (`health`, `allocation`,
//! `nodeLabels`, `dynamicMig`). Unknown fields are errors: a typo must not silently fall back
//! to a default on a thousand nodes.

use crate::inventory::ResourceName;
use crate::report::chain;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

mod select;

pub use crate::gpu_select::{GpuSelect, InvalidField};
pub use select::check_shared_and_dynamic;

/// Xids that NVIDIA's device plugin ignores by default: application errors that do not mean the
/// GPU is broken (13 graphics engine exception, 31 MMU fault, 43 GPU stopped processing,
/// 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout).
pub const DEFAULT_SKIPPED_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading config file {path}: {}", chain(.cause))]
    Read { path: String, cause: std::io::Error },
    /// The file is not valid YAML for the schema.
    #[error("config file {path}: {}", chain(.cause))]
    Parse {
        path: String,
        cause: serde_yaml_ng::Error,
    },
    /// A value is out of range or inconsistent.
    #[error("config file {path}: `{field}`: {reason}")]
    Invalid {
        path: String,
        field: String,
        reason: String,
    },
}

/// How MIG devices are offered through the device plugin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigStrategy {
    /// Whole GPUs only, as `nvidia.com/gpu`; MIG devices are not offered.
    #[default]
    None,
    /// MIG devices as `nvidia.com/gpu`; all of them must have the same profile.
    Single,
    /// `nvidia.com/mig-<profile>` per profile, plus whole GPUs that have MIG off.
    Mixed,
}

/// How Allocate tells the runtime which devices to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceListStrategy {
    /// CDI device names in `ContainerAllocateResponse.cdi_devices`.
    CdiCri,
    /// `NVIDIA_VISIBLE_DEVICES` for the NVIDIA container runtime.
    Envvar,
}

/// Which identifier of a device the kubelet sees and `NVIDIA_VISIBLE_DEVICES` carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceIdStrategy {
    #[default]
    Uuid,
    Index,
}

/// One strategy or a list of them, as NVIDIA's config allows.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(DeviceListStrategy),
    Many(Vec<DeviceListStrategy>),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    flags: RawFlags,
    #[serde(default)]
    sharing: RawSharing,
    #[serde(default)]
    health: RawHealth,
    #[serde(default)]
    allocation: RawAllocation,
    #[serde(default)]
    node_labels: RawNodeLabels,
    /// Absent: off. Present, even empty (`dynamicMig:`): on, for the GPUs it selects.
    #[serde(default, deserialize_with = "present")]
    dynamic_mig: Option<Option<crate::dynamic_mig::RawDynamicMig>>,
}

/// A section that may be written empty: `Some(None)` when it is there but null.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawNodeLabels {
    #[serde(default)]
    enabled: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawAllocation {
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    dra_gpus: Option<Vec<u32>>,
    #[serde(default)]
    mig_to_dra: Option<bool>,
    #[serde(default)]
    pod_resources_grace: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawFlags {
    #[serde(default)]
    mig_strategy: Option<MigStrategy>,
    #[serde(default)]
    plugin: RawPlugin,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawPlugin {
    #[serde(default)]
    device_list_strategy: Option<OneOrMany>,
    #[serde(default, rename = "deviceIDStrategy")]
    device_id_strategy: Option<DeviceIdStrategy>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawSharing {
    #[serde(default)]
    time_slicing: Option<RawTimeSlicing>,
    #[serde(default)]
    consumable_capacity: Option<crate::sharing::RawShares>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawTimeSlicing {
    #[serde(default)]
    rename_by_default: bool,
    #[serde(default)]
    fail_requests_greater_than_one: bool,
    #[serde(default)]
    resources: Vec<RawReplicated>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawReplicated {
    name: String,
    replicas: u32,
    #[serde(default)]
    rename: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawHealth {
    #[serde(default)]
    skip_xids: Option<Vec<u64>>,
    #[serde(default)]
    critical_xids: Option<Vec<u64>>,
    #[serde(default)]
    recovery_quiet_period: Option<String>,
    #[serde(default)]
    inventory_refresh: Option<String>,
}

/// Time-slicing of one resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replication {
    /// The resource being shared, e.g. `nvidia.com/gpu` or `nvidia.com/mig-1g.10gb`.
    pub name: ResourceName,
    pub replicas: u32,
    /// Name the shared resource is advertised under (`<name>.shared` with renameByDefault).
    pub advertised_as: ResourceName,
}

/// Which Xids mark a device unhealthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XidPolicy {
    /// Every Xid except these.
    AllExcept(BTreeSet<u64>),
    /// Only these Xids.
    Only(BTreeSet<u64>),
}

impl XidPolicy {
    pub fn is_critical(&self, xid: u64) -> bool {
        match self {
            XidPolicy::AllExcept(skip) => !skip.contains(&xid),
            XidPolicy::Only(list) => list.contains(&xid),
        }
    }
}

/// How the device plugin API and DRA share the node's devices.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum AllocationMode {
    /// Both APIs may hand out any device; the allocation ledger keeps them apart.
    #[default]
    Shared,
    /// A static split: each API only ever sees its own devices.
    Partitioned(Partition),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Partition {
    /// These GPUs (whole or as MIG devices) go to DRA; the rest to the device plugin.
    DraGpus(BTreeSet<u32>),
    /// MIG devices go to DRA, whole GPUs (MIG off) to the device plugin.
    MigToDra,
}

/// The validated agent configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    pub mig_strategy: MigStrategy,
    pub device_list_strategy: BTreeSet<DeviceListStrategy>,
    pub device_id_strategy: DeviceIdStrategy,
    pub time_slicing: Vec<Replication>,
    pub fail_requests_greater_than_one: bool,
    pub xid_policy: XidPolicy,
    /// A device marked unhealthy by an Xid becomes healthy again after this long without one.
    pub recovery_quiet_period: Duration,
    /// How often the inventory is read again (MIG reconfiguration, lost GPUs coming back).
    pub inventory_refresh: Duration,
    pub allocation: AllocationMode,
    /// A device-plugin Allocate that no PodResources listing sent this long after it shows is
    /// released (the kubelet never tells a plugin that a pod ended, and it records an
    /// Allocate's devices as soon as the call returns, so a later listing without them means
    /// the container is gone). At least [`MIN_POD_RESOURCES_GRACE`].
    pub pod_resources_grace: Duration,
    /// Label the node with GPU Feature Discovery's `nvidia.com/*` labels (src/labels.rs).
    pub node_labels: bool,
    /// Fractional GPUs through DRA consumable capacity (`sharing.consumableCapacity`); off
    /// when `None`.
    pub shares: Option<crate::sharing::ShareConfig>,
    /// Dynamic MIG (`dynamicMig`): the GPUs gpuplane partitions as claims need; off when
    /// `None`. A GPU that takes part is never also a shared unit ([`check_shared_and_dynamic`]).
    pub dynamic_mig: Option<crate::dynamic_mig::DynamicMigConfig>,
}

/// The shortest `allocation.podResourcesGrace`: below it a listing could race the kubelet's
/// record of a just-returned Allocate and free a device its container is about to use.
pub const MIN_POD_RESOURCES_GRACE: Duration = Duration::from_millis(500);

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            mig_strategy: MigStrategy::None,
            device_list_strategy: BTreeSet::from([DeviceListStrategy::CdiCri]),
            device_id_strategy: DeviceIdStrategy::Uuid,
            time_slicing: Vec::new(),
            fail_requests_greater_than_one: false,
            xid_policy: XidPolicy::AllExcept(DEFAULT_SKIPPED_XIDS.iter().copied().collect()),
            recovery_quiet_period: Duration::from_secs(300),
            inventory_refresh: Duration::from_secs(30),
            allocation: AllocationMode::Shared,
            pod_resources_grace: Duration::from_secs(1),
            node_labels: true,
            shares: None,
            dynamic_mig: None,
        }
    }
}

/// Parses durations like `300ms`, `30s`, `5m`, `1h`, `1h 30m` (humantime's grammar; a bare
/// number has no unit and is refused).
pub fn parse_duration(s: &str) -> Option<Duration> {
    humantime::parse_duration(s.trim()).ok()
}

/// An invalid field of the config file at `path`.
/// A section's [`InvalidField`], in the file at `path`.
fn in_file(path: &str, e: InvalidField) -> ConfigError {
    invalid(path, &e.field, e.reason)
}

fn invalid(path: &str, field: &str, reason: String) -> ConfigError {
    ConfigError::Invalid {
        path: path.to_string(),
        field: field.to_string(),
        reason,
    }
}

impl AgentConfig {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<AgentConfig, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: name.clone(),
            cause: source,
        })?;
        Self::parse(&name, &text)
    }

    /// Validates config text; `path` names it in errors.
    pub fn parse(path: &str, text: &str) -> Result<AgentConfig, ConfigError> {
        // An empty file is a valid, all-defaults config.
        let raw: RawFile = if text.trim().is_empty() {
            RawFile::default()
        } else {
            serde_yaml_ng::from_str(text).map_err(|source| ConfigError::Parse {
                path: path.to_string(),
                cause: source,
            })?
        };
        if let Some(v) = &raw.version {
            if v != "v1" {
                return Err(invalid(
                    path,
                    "version",
                    format!("unsupported version `{v}`; use v1"),
                ));
            }
        }
        let mut cfg = AgentConfig::default();
        if let Some(m) = raw.flags.mig_strategy {
            cfg.mig_strategy = m;
        }
        if let Some(s) = raw.flags.plugin.device_list_strategy {
            let list = match s {
                OneOrMany::One(one) => vec![one],
                OneOrMany::Many(many) => many,
            };
            if list.is_empty() {
                return Err(invalid(
                    path,
                    "flags.plugin.deviceListStrategy",
                    "needs at least one of cdi-cri, envvar".into(),
                ));
            }
            cfg.device_list_strategy = list.into_iter().collect();
        }
        if let Some(s) = raw.flags.plugin.device_id_strategy {
            cfg.device_id_strategy = s;
        }
        if let Some(ts) = raw.sharing.time_slicing {
            cfg.apply_time_slicing(path, ts)?;
        }
        if let Some(cc) = raw.sharing.consumable_capacity {
            cfg.shares = Some(cc.validate().map_err(|e| in_file(path, e))?);
        }
        if let Some(section) = raw.dynamic_mig {
            let dynamic = section
                .unwrap_or_default()
                .validate()
                .map_err(|e| in_file(path, e))?;
            check_shared_and_dynamic(path, cfg.shares.as_ref(), &dynamic)?;
            cfg.dynamic_mig = Some(dynamic);
        }
        cfg.apply_health(path, raw.health)?;
        if let Some(on) = raw.node_labels.enabled {
            cfg.node_labels = on;
        }
        cfg.apply_allocation(path, raw.allocation)?;
        Ok(cfg)
    }

    /// The `sharing.timeSlicing` section: which resources are advertised as replicas.
    fn apply_time_slicing(&mut self, path: &str, ts: RawTimeSlicing) -> Result<(), ConfigError> {
        self.fail_requests_greater_than_one = ts.fail_requests_greater_than_one;
        let mut seen = BTreeSet::new();
        for (i, r) in ts.resources.into_iter().enumerate() {
            let field = format!("sharing.timeSlicing.resources[{i}]");
            let name = ResourceName::parse(r.name.as_str())
                .map_err(|e| invalid(path, &format!("{field}.name"), e.to_string()))?;
            if name.domain() != "nvidia.com" {
                return Err(invalid(path, &format!("{field}.name"), format!("`{}` is not a resource gpuplane serves (nvidia.com/gpu or nvidia.com/mig-<profile>)", r.name)));
            }
            if !(2..=1024).contains(&r.replicas) {
                return Err(invalid(
                    path,
                    &format!("{field}.replicas"),
                    format!("{} is out of range; use 2 to 1024", r.replicas),
                ));
            }
            if !seen.insert(name.clone()) {
                return Err(invalid(
                    path,
                    &format!("{field}.name"),
                    format!("`{}` is listed twice", r.name),
                ));
            }
            let advertised_as = match r.rename {
                Some(n) => ResourceName::parse(n)
                    .map_err(|e| invalid(path, &format!("{field}.rename"), e.to_string()))?,
                None if ts.rename_by_default => name.shared().map_err(|e| {
                    invalid(path, "sharing.timeSlicing.renameByDefault", e.to_string())
                })?,
                None => name.clone(),
            };
            self.time_slicing.push(Replication {
                name,
                replicas: r.replicas,
                advertised_as,
            });
        }
        Ok(())
    }

    /// The `health` section: which XIDs count, and the recovery and refresh periods.
    fn apply_health(&mut self, path: &str, health: RawHealth) -> Result<(), ConfigError> {
        match (health.skip_xids, health.critical_xids) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    path,
                    "health",
                    "set skipXids or criticalXids, not both".into(),
                ))
            }
            (Some(skip), None) => {
                self.xid_policy = XidPolicy::AllExcept(skip.into_iter().collect())
            }
            (None, Some(only)) => self.xid_policy = XidPolicy::Only(only.into_iter().collect()),
            (None, None) => {}
        }
        if let Some(q) = health.recovery_quiet_period {
            self.recovery_quiet_period = parse_duration(&q).ok_or_else(|| {
                invalid(
                    path,
                    "health.recoveryQuietPeriod",
                    format!("`{q}` is not a duration like 30s or 5m"),
                )
            })?;
        }
        if let Some(q) = health.inventory_refresh {
            self.inventory_refresh =
                parse_duration(&q).filter(|d| !d.is_zero()).ok_or_else(|| {
                    invalid(
                        path,
                        "health.inventoryRefresh",
                        format!("`{q}` is not a positive duration like 30s"),
                    )
                })?;
        }
        Ok(())
    }

    /// The `allocation` section: shared, or partitioned between the device plugin and DRA.
    fn apply_allocation(&mut self, path: &str, a: RawAllocation) -> Result<(), ConfigError> {
        if let Some(g) = &a.pod_resources_grace {
            let field = "allocation.podResourcesGrace";
            let grace = parse_duration(g)
                .ok_or_else(|| invalid(path, field, format!("`{g}` is not a duration like 1s")))?;
            if grace < MIN_POD_RESOURCES_GRACE {
                return Err(invalid(
                    path,
                    field,
                    format!(
                        "`{g}` is shorter than {MIN_POD_RESOURCES_GRACE:?}: the kubelet records an \
                         Allocate's devices just after the call returns, and a listing sent sooner \
                         may not show them yet (use 1s, the default)"
                    ),
                ));
            }
            self.pod_resources_grace = grace;
        }
        self.allocation = match (a.mode.as_deref(), a.dra_gpus, a.mig_to_dra) {
            (None | Some("shared"), None, None | Some(false)) => AllocationMode::Shared,
            (None | Some("shared"), _, _) => {
                return Err(invalid(
                    path,
                    "allocation",
                    "draGpus and migToDra need `mode: partitioned`".into(),
                ));
            }
            (Some("partitioned"), Some(gpus), None | Some(false)) => {
                AllocationMode::Partitioned(Partition::DraGpus(gpus.into_iter().collect()))
            }
            (Some("partitioned"), None, Some(true)) => {
                AllocationMode::Partitioned(Partition::MigToDra)
            }
            (Some("partitioned"), _, _) => {
                return Err(invalid(
                    path,
                    "allocation",
                    "`mode: partitioned` needs exactly one of draGpus: [indices] or migToDra: true"
                        .into(),
                ));
            }
            (Some(other), _, _) => {
                return Err(invalid(
                    path,
                    "allocation.mode",
                    format!("unknown mode `{other}`; use shared or partitioned"),
                ))
            }
        };
        Ok(())
    }

    /// The time-slicing entry for a resource, if it is shared.
    pub fn replication(&self, resource: &str) -> Option<&Replication> {
        self.time_slicing.iter().find(|r| r.name == resource)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_gives_the_documented_defaults() {
        let c = AgentConfig::parse("c.yaml", "").unwrap();
        assert_eq!(c, AgentConfig::default());
        assert!(!c.xid_policy.is_critical(13) && !c.xid_policy.is_critical(109));
        assert!(c.xid_policy.is_critical(79) && c.xid_policy.is_critical(48));
    }

    #[test]
    fn nvidia_style_config_is_accepted() {
        let c = AgentConfig::parse(
            "c.yaml",
            r#"
version: v1
flags:
  migStrategy: mixed
  plugin:
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: index
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
health:
  criticalXids: [48, 79]
  recoveryQuietPeriod: 2m
"#,
        )
        .unwrap();
        assert_eq!(c.mig_strategy, MigStrategy::Mixed);
        assert_eq!(c.device_list_strategy.len(), 2);
        assert_eq!(c.device_id_strategy, DeviceIdStrategy::Index);
        assert_eq!(
            c.replication("nvidia.com/gpu").unwrap().advertised_as,
            "nvidia.com/gpu.shared"
        );
        assert!(c.fail_requests_greater_than_one);
        assert!(c.xid_policy.is_critical(48) && !c.xid_policy.is_critical(31));
        assert_eq!(c.recovery_quiet_period, Duration::from_secs(120));
    }

    #[test]
    fn bad_values_name_the_field() {
        for (text, field) in [
            (
                "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 1}]}}",
                "sharing.timeSlicing.resources[0].replicas",
            ),
            (
                "sharing: {timeSlicing: {resources: [{name: amd.com/gpu, replicas: 2}]}}",
                "sharing.timeSlicing.resources[0].name",
            ),
            (
                "health: {recoveryQuietPeriod: soon}",
                "health.recoveryQuietPeriod",
            ),
            ("health: {skipXids: [1], criticalXids: [2]}", "health"),
            ("version: v2", "version"),
            ("allocation: {mode: split}", "allocation.mode"),
            ("allocation: {mode: partitioned}", "allocation"),
            ("allocation: {draGpus: [1]}", "allocation"),
            (
                "allocation: {podResourcesGrace: 0s}",
                "allocation.podResourcesGrace",
            ),
            (
                "allocation: {podResourcesGrace: 100ms}",
                "allocation.podResourcesGrace",
            ),
            (
                "allocation: {podResourcesGrace: soon}",
                "allocation.podResourcesGrace",
            ),
        ] {
            match AgentConfig::parse("c.yaml", text) {
                Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn resource_names_are_checked_naming_the_field_and_value() {
        let long = "a".repeat(60);
        for (text, field, value) in [
            (
                "sharing: {timeSlicing: {resources: [{name: 'nvidia.com/gpu,x', replicas: 2}]}}".to_string(),
                "sharing.timeSlicing.resources[0].name",
                "nvidia.com/gpu,x",
            ),
            (
                "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, rename: Shared}]}}".to_string(),
                "sharing.timeSlicing.resources[0].rename",
                "Shared",
            ),
            (
                format!("sharing: {{timeSlicing: {{renameByDefault: true, resources: [{{name: nvidia.com/{long}, replicas: 2}}]}}}}"),
                "sharing.timeSlicing.renameByDefault",
                &format!("nvidia.com/{long}.shared"),
            ),
        ] {
            match AgentConfig::parse("c.yaml", &text) {
                Err(ConfigError::Invalid { field: f, reason, .. }) => {
                    assert_eq!(f, field, "{text}");
                    assert!(reason.contains(&format!("resource name {value:?}")), "{reason}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_fields_and_values_are_parse_errors() {
        assert!(matches!(
            AgentConfig::parse("c.yaml", "flags: {migStrategy: double}"),
            Err(ConfigError::Parse { .. })
        ));
        assert!(matches!(
            AgentConfig::parse("c.yaml", "flag: {}"),
            Err(ConfigError::Parse { .. })
        ));
        let msg = AgentConfig::parse(
            "c.yaml",
            "flags: {plugin: {deviceListStrategy: volume-mounts}}",
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("c.yaml"), "{msg}");
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("300ms"), Some(Duration::from_millis(300)));
        assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h 30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("5"), None);
        assert_eq!(parse_duration("m"), None);
        assert_eq!(parse_duration("-5s"), None);
    }
}
