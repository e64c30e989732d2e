//! What a published device's facts (its node, NUMA node and taints, kept by the catalog) mean
//! for a request: whether its taints let the request have it, and why our agent marked it
//! unhealthy. The topology answer counts free GPUs per NUMA node with it; the health answer
//! names unhealthy or tainted devices with it.

use crate::slices::render::IN_USE_TAINT_KEY;
use crate::slices::UNHEALTHY_TAINT_KEY;
use k8s_openapi::api::core::v1::{Taint, Toleration};
use k8s_openapi::api::resource::v1::DeviceToleration;

pub use crate::quota::DeviceFacts;

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
