//! What the ResourceSlices say of each published device beyond what the quota catalog keeps:
//! the node it sits on, its NUMA node and its taints. The topology answer counts free GPUs per
//! NUMA node from it; the health answer names unhealthy or tainted devices from it.

use crate::slices::render::{names, IN_USE_TAINT_KEY};
use crate::slices::UNHEALTHY_TAINT_KEY;
use k8s_openapi::api::core::v1::{Taint, Toleration};
use k8s_openapi::api::resource::v1::{DeviceTaint, DeviceToleration, ResourceSlice};
use std::collections::BTreeMap;

/// (driver, pool, device).
pub type Key = (String, String, String);

/// One published device as the slices show it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceFacts {
    /// The slice's `nodeName` (our agent's pool is named after its node).
    pub node: Option<String>,
    /// `resource.kubernetes.io/numaNode`, when published.
    pub numa: Option<i64>,
    pub taints: Vec<DeviceTaint>,
}

/// Whether a device can be given to a new request, as far as its taints say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Usable {
    Yes,
    /// Held through the device plugin API (our agent's in-use taint): taken, not unhealthy.
    InUse,
    /// A taint the request does not tolerate, as `key=value:effect`.
    Tainted(String),
}

impl DeviceFacts {
    /// The first taint that keeps `tolerations` off the device, if any.
    pub fn usable(&self, tolerations: &[DeviceToleration]) -> Usable {
        for t in &self.taints {
            if t.effect != "NoSchedule" && t.effect != "NoExecute" {
                continue;
            }
            if t.key == IN_USE_TAINT_KEY {
                return Usable::InUse;
            }
            let taint = Taint {
                key: t.key.clone(),
                value: t.value.clone(),
                effect: t.effect.clone(),
                time_added: None,
            };
            if !tolerations
                .iter()
                .any(|o| super::placement::tolerates(&pod_toleration(o), &taint))
            {
                let value = t
                    .value
                    .as_deref()
                    .map(|v| format!("={v}"))
                    .unwrap_or_default();
                return Usable::Tainted(format!("{}{value}:{}", t.key, t.effect));
            }
        }
        Usable::Yes
    }

    /// Why our agent marked the device unhealthy (`xid-48`, `lost`), if it did.
    pub fn unhealthy(&self) -> Option<&str> {
        self.taints
            .iter()
            .find(|t| t.key == UNHEALTHY_TAINT_KEY)
            .map(|t| t.value.as_deref().unwrap_or("unhealthy"))
    }
}

/// A device toleration read as a pod toleration: the same fields and the same rule.
fn pod_toleration(o: &DeviceToleration) -> Toleration {
    Toleration {
        key: o.key.clone(),
        operator: o.operator.clone(),
        value: o.value.clone(),
        effect: o.effect.clone(),
        toleration_seconds: o.toleration_seconds,
    }
}

/// Every device of `slices`, by (driver, pool, device).
pub fn facts<S: std::borrow::Borrow<ResourceSlice>>(slices: &[S]) -> BTreeMap<Key, DeviceFacts> {
    let mut out = BTreeMap::new();
    for s in slices.iter().map(std::borrow::Borrow::borrow) {
        let spec = &s.spec;
        for d in spec.devices.iter().flatten() {
            let numa = d
                .attributes
                .as_ref()
                .and_then(|a| a.get(names::NUMA_NODE))
                .and_then(|a| a.int);
            let key = (spec.driver.clone(), spec.pool.name.clone(), d.name.clone());
            let facts = DeviceFacts {
                node: spec.node_name.clone(),
                numa,
                taints: d.taints.clone().unwrap_or_default(),
            };
            out.insert(key, facts);
        }
    }
    out
}
