//! The CDI spec file format (the subset gpuplane writes) and the version rules.
//!
//! Field names and optionality follow `container-device-interface/specs-go/config.go`; empty
//! lists, maps and `None` are left out when serialising. [`minimum_version`] is the Rust form of
//! `MinimumRequiredVersion` in `specs-go/version.go`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A CDI spec file: one `kind` and the devices of that kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    /// `vendor/class`.
    pub kind: String,
    /// Spec-level annotations (cdiVersion 0.6.0).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    /// Edits applied once whenever any device of this spec is injected.
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// One injectable device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    /// Device-level annotations (cdiVersion 0.6.0).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub container_edits: ContainerEdits,
}

/// Changes a runtime makes to a container's OCI spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=value` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// Supplementary group ids for the container process (cdiVersion 0.7.0).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        rename = "additionalGids"
    )]
    pub additional_gids: Vec<u32>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.hooks.is_empty()
            && self.mounts.is_empty()
            && self.additional_gids.is_empty()
    }
}

/// A device node to create in the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path inside the container.
    pub path: String,
    /// Path on the host when it differs from `path` (cdiVersion 0.5.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c`, `b` or `p`; the runtime stats the host node when absent.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "type")]
    pub node_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// cgroup permissions, e.g. `rw`, `rwm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

/// A bind (or other) mount.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    /// Mount type (cdiVersion 0.4.0); a bind mount when absent.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "type")]
    pub mount_type: Option<String>,
}

/// An OCI hook.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// OCI lifecycle stage, e.g. `createContainer`.
    pub hook_name: String,
    /// Host path of the executable.
    pub path: String,
    /// Full argv, `args[0]` included.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
}

/// The oldest cdiVersion gpuplane emits (CDI's `vEarliest`).
pub const V030: &str = "0.3.0";
pub const V040: &str = "0.4.0";
pub const V050: &str = "0.5.0";
pub const V060: &str = "0.6.0";
pub const V070: &str = "0.7.0";

/// The highest cdiVersion podman 4.3 (Debian 12) accepts; what the tests hold the rendered
/// specs to (`minimum_version` keeps them there).
#[doc(hidden)]
pub const PODMAN_4_3_MAX: &str = V050;

/// The lowest cdiVersion whose schema covers every field `spec` uses, so older runtimes still
/// read it. Rules, from `specs-go/version.go`:
///
/// - 0.3.0: the base (oldest still accepted);
/// - 0.4.0: a mount has `type`;
/// - 0.5.0: a device node has `hostPath`, or a device name does not start with a letter;
/// - 0.6.0: annotations (spec or device level), or a `.` in the kind's class;
/// - 0.7.0: `additionalGids` (spec or device level) or `intelRdt` (not modelled here);
/// - 0.8.0: no field of its own (it removed Go helper functions), so never required.
pub fn minimum_version(spec: &Spec) -> &'static str {
    let all_edits = || {
        std::iter::once(&spec.container_edits)
            .chain(spec.devices.iter().map(|d| &d.container_edits))
    };
    if all_edits().any(|e| !e.additional_gids.is_empty()) {
        return V070;
    }
    let class_has_dot = spec
        .kind
        .split_once('/')
        .is_some_and(|(_, class)| class.contains('.'));
    if !spec.annotations.is_empty()
        || spec.devices.iter().any(|d| !d.annotations.is_empty())
        || class_has_dot
    {
        return V060;
    }
    let name_not_letter = spec
        .devices
        .iter()
        .any(|d| !d.name.is_empty() && !d.name.starts_with(|c: char| c.is_ascii_alphabetic()));
    if name_not_letter || all_edits().any(|e| e.device_nodes.iter().any(|n| n.host_path.is_some()))
    {
        return V050;
    }
    if all_edits().any(|e| e.mounts.iter().any(|m| m.mount_type.is_some())) {
        return V040;
    }
    V030
}

/// Orders two `x.y.z` versions numerically; unparsable parts compare as 0.
pub fn compare_versions(a: &str, b: &str) -> std::cmp::Ordering {
    let parts = |v: &str| -> Vec<u64> {
        v.trim_start_matches('v')
            .split('.')
            .map(|p| p.parse().unwrap_or(0))
            .collect()
    };
    parts(a).cmp(&parts(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(name: &str, node: DeviceNode) -> Device {
        Device {
            name: name.into(),
            annotations: BTreeMap::new(),
            container_edits: ContainerEdits {
                device_nodes: vec![node],
                ..Default::default()
            },
        }
    }

    fn node(path: &str) -> DeviceNode {
        DeviceNode {
            path: path.into(),
            ..Default::default()
        }
    }

    fn base() -> Spec {
        Spec {
            cdi_version: String::new(),
            kind: "nvidia.com/gpu".into(),
            devices: vec![device("gpu0", node("/dev/nvidia0"))],
            ..Default::default()
        }
    }

    #[test]
    fn plain_spec_needs_only_0_3_0() {
        let mut s = base();
        s.container_edits.mounts.push(Mount {
            host_path: "/usr/lib/libcuda.so.1".into(),
            container_path: "/usr/lib/libcuda.so.1".into(),
            options: vec!["ro".into(), "bind".into()],
            mount_type: None,
        });
        s.container_edits.env.push("A=b".into());
        assert_eq!(minimum_version(&s), "0.3.0");
    }

    #[test]
    fn version_rules() {
        let mut s = base();
        s.container_edits.mounts.push(Mount {
            mount_type: Some("bind".into()),
            ..Default::default()
        });
        assert_eq!(minimum_version(&s), "0.4.0");

        let mut s = base();
        s.devices[0].container_edits.device_nodes[0].host_path = Some("/host/dev/nvidia0".into());
        assert_eq!(minimum_version(&s), "0.5.0");

        let mut s = base();
        s.container_edits.device_nodes.push(DeviceNode {
            host_path: Some("/host/dev/nvidiactl".into()),
            ..node("/dev/nvidiactl")
        });
        assert_eq!(minimum_version(&s), "0.5.0");

        let mut s = base();
        s.devices.push(device("0", node("/dev/nvidia0")));
        assert_eq!(minimum_version(&s), "0.5.0");

        let mut s = base();
        s.annotations.insert("a".into(), "b".into());
        assert_eq!(minimum_version(&s), "0.6.0");
        let mut s = base();
        s.devices[0].annotations.insert("a".into(), "b".into());
        assert_eq!(minimum_version(&s), "0.6.0");
        let mut s = base();
        s.kind = "example.com/gpu.shared".into();
        assert_eq!(minimum_version(&s), "0.6.0");

        let mut s = base();
        s.devices[0].container_edits.additional_gids.push(44);
        s.devices.push(device("0", node("/dev/nvidia0")));
        assert_eq!(minimum_version(&s), "0.7.0");
    }

    #[test]
    fn serialises_without_empty_fields() {
        let mut s = base();
        s.cdi_version = minimum_version(&s).into();
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "cdiVersion": "0.3.0",
                "kind": "nvidia.com/gpu",
                "devices": [{"name": "gpu0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}]
            })
        );
        let back: Spec = serde_json::from_value(json).unwrap();
        assert_eq!(back, s);

        let full = DeviceNode {
            path: "/dev/x".into(),
            host_path: Some("/h/dev/x".into()),
            node_type: Some("c".into()),
            major: Some(195),
            minor: Some(0),
            permissions: Some("rw".into()),
        };
        assert_eq!(
            serde_json::to_value(&full).unwrap(),
            serde_json::json!({"path": "/dev/x", "hostPath": "/h/dev/x", "type": "c",
                "major": 195, "minor": 0, "permissions": "rw"})
        );
        let hook = Hook {
            hook_name: "createContainer".into(),
            path: "/usr/bin/nvidia-cdi-hook".into(),
            args: vec!["nvidia-cdi-hook".into()],
            env: vec![],
        };
        assert_eq!(
            serde_json::to_value(&hook).unwrap(),
            serde_json::json!({"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                "args": ["nvidia-cdi-hook"]})
        );
    }

    #[test]
    fn compares_versions_numerically() {
        use std::cmp::Ordering::*;
        assert_eq!(compare_versions("0.10.0", "0.5.0"), Greater);
        assert_eq!(compare_versions("0.5.0", PODMAN_4_3_MAX), Equal);
        assert_eq!(compare_versions("0.3.0", "0.5.0"), Less);
    }
}
