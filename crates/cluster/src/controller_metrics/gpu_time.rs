//! The GPU-hours ledger's counters: `gpuplane_gpu_seconds_total`,
//! `gpuplane_gpu_memory_byte_seconds_total` and `gpuplane_busy_gpu_seconds_total` per namespace
//! and owner label values (each `--owner-label` key as a label `label_<key>`, its characters
//! outside `[A-Za-z0-9_]` as `_`, as kube-state-metrics names pod labels), and the same three
//! as `gpuplane_quota_*_total` per GpuQuota. They grow by what each flush of the book added, so
//! they restart from zero with a new leader (a counter reset to Prometheus) while the book
//! carries on. Past [`MAX_SERIES`] owner combinations a new one is counted with every owner
//! value [`OTHER`].

use super::QuotaLabels;
use crate::metrics::register;
use gpuplane_model::controller::hours::{Series, Totals, OTHER};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

/// Owner series kept at most per family.
pub const MAX_SERIES: usize = 5000;

type Seconds = Counter<f64, AtomicU64>;
type OwnerLabels = Vec<(String, String)>;

#[derive(Debug, Default)]
pub(super) struct GpuTime {
    tenant_gpu: Family<OwnerLabels, Seconds>,
    tenant_memory: Family<OwnerLabels, Seconds>,
    tenant_busy: Family<OwnerLabels, Seconds>,
    quota_gpu: Family<QuotaLabels, Seconds>,
    quota_memory: Family<QuotaLabels, Seconds>,
    quota_busy: Family<QuotaLabels, Seconds>,
    seen: Mutex<HashSet<OwnerLabels>>,
}

/// A label name for an owner label key.
pub fn label_name(key: &str) -> String {
    let clean: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("label_{clean}")
}

impl GpuTime {
    pub(super) fn register(r: &mut Registry) -> GpuTime {
        let help = "GPU time of GPU pods in whole-GPU-equivalent seconds (MIG slices and shares as their fraction), by namespace and owner labels";
        let mem = "GPU memory held by GPU pods times seconds, by namespace and owner labels";
        GpuTime {
            tenant_gpu: register(r, "gpuplane_gpu_seconds", help, Family::default()),
            tenant_memory: register(
                r,
                "gpuplane_gpu_memory_byte_seconds",
                mem,
                Family::default(),
            ),
            tenant_busy: register(
                r,
                "gpuplane_busy_gpu_seconds",
                "Utilization-weighted GPU-seconds the GPU pods' devices were busy (from the agents' telemetry through Prometheus), by namespace and owner labels",
                Family::default(),
            ),
            quota_busy: register(
                r,
                "gpuplane_quota_busy_gpu_seconds",
                "Utilization-weighted GPU-seconds the devices of the pods a GpuQuota governs were busy",
                Family::default(),
            ),
            quota_gpu: register(
                r,
                "gpuplane_quota_gpu_seconds",
                "GPU time of the pods a GpuQuota governs, in whole-GPU-equivalent seconds",
                Family::default(),
            ),
            quota_memory: register(
                r,
                "gpuplane_quota_gpu_memory_byte_seconds",
                "GPU memory times seconds of the pods a GpuQuota governs",
                Family::default(),
            ),
            seen: Mutex::default(),
        }
    }

    /// Adds what a flush added; `owner_keys` name the owner values of tenant series.
    pub(super) fn add(&self, owner_keys: &[String], added: &BTreeMap<Series, Totals>) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        for (series, t) in added {
            match series {
                Series::Tenant { namespace, owners } => {
                    let labels = |values: &mut dyn Iterator<Item = String>| -> OwnerLabels {
                        std::iter::once(("namespace".to_string(), namespace.clone()))
                            .chain(owner_keys.iter().map(|k| label_name(k)).zip(values))
                            .collect()
                    };
                    let mut l = labels(&mut owners.iter().cloned());
                    if !seen.contains(&l) {
                        if seen.len() >= MAX_SERIES {
                            l = labels(&mut std::iter::repeat_with(|| OTHER.to_string()));
                        }
                        seen.insert(l.clone());
                    }
                    self.tenant_gpu.get_or_create(&l).inc_by(t.gpu_seconds);
                    self.tenant_memory
                        .get_or_create(&l)
                        .inc_by(t.gpu_memory_byte_seconds);
                    self.tenant_busy
                        .get_or_create(&l)
                        .inc_by(t.busy_gpu_seconds);
                }
                Series::Quota { namespace, quota } => {
                    let l = QuotaLabels {
                        namespace: namespace.clone(),
                        quota: quota.clone(),
                    };
                    self.quota_gpu.get_or_create(&l).inc_by(t.gpu_seconds);
                    self.quota_memory
                        .get_or_create(&l)
                        .inc_by(t.gpu_memory_byte_seconds);
                    self.quota_busy.get_or_create(&l).inc_by(t.busy_gpu_seconds);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::render;

    fn tenant(ns: &str, owners: &[&str]) -> Series {
        Series::Tenant {
            namespace: ns.into(),
            owners: owners.iter().map(|o| o.to_string()).collect(),
        }
    }

    #[test]
    fn flushes_add_to_counters_by_tenant_and_quota_and_new_owners_past_the_cap_are_other() {
        let mut r = Registry::default();
        let g = GpuTime::register(&mut r);
        let keys = ["team".to_string(), "cost-center".to_string()];
        let t = |g: f64| Totals {
            gpu_seconds: g,
            gpu_memory_byte_seconds: g * 1024.0,
            busy_gpu_seconds: g / 2.0,
            peak_gpu_memory_bytes: 0.0,
        };
        let quota = Series::Quota {
            namespace: "a".into(),
            quota: "default".into(),
        };
        for _ in 0..2 {
            let added = BTreeMap::from([
                (tenant("a", &["ml", "cc-1"]), t(1.5)),
                (quota.clone(), t(1.5)),
            ]);
            g.add(&keys, &added);
        }
        for i in 0..MAX_SERIES {
            g.add(
                &keys,
                &BTreeMap::from([(tenant("b", &[&format!("t{i}"), ""]), t(1.0))]),
            );
        }
        let text = render(&[&r]);
        for line in [
            "gpuplane_gpu_seconds_total{namespace=\"a\",label_team=\"ml\",label_cost_center=\"cc-1\"} 3.0",
            "gpuplane_gpu_memory_byte_seconds_total{namespace=\"a\",label_team=\"ml\",label_cost_center=\"cc-1\"} 3072.0",
            "gpuplane_quota_gpu_seconds_total{namespace=\"a\",quota=\"default\"} 3.0",
            "gpuplane_busy_gpu_seconds_total{namespace=\"a\",label_team=\"ml\",label_cost_center=\"cc-1\"} 1.5",
            "gpuplane_quota_busy_gpu_seconds_total{namespace=\"a\",quota=\"default\"} 1.5",
            "gpuplane_gpu_seconds_total{namespace=\"b\",label_team=\"_other\",label_cost_center=\"_other\"} 1.0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing");
        }
        assert_eq!(label_name("example.com/team"), "label_example_com_team");
    }
}
