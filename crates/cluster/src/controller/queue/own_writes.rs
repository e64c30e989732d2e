//! What the quota loop wrote that its caches have not shown yet: GpuQuota statuses (newer than
//! the cache until its watch catches up), pods whose gate it removed, and when it last wrote
//! each namespace's quotas (settling usage is held back for a while after).

use super::error::api_error;
use super::QueueError;
use crate::controller::cache::Cache;
use crate::controller::namespace::Decision;
use crate::controller::pods;
use crate::controller::quota_ledger::{compact, Working};
use crate::controller_metrics::QueueMetrics;
use crate::quota::GpuQuota;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The loop's own writes, remembered until the watches show them.
#[derive(Default)]
pub(super) struct OwnWrites {
    /// Our last writes of GpuQuotas, by id, newer than the cache until its watch catches up.
    quotas: HashMap<String, GpuQuota>,
    /// Pods we ungated, by uid, with their namespace and when, until the cache shows it.
    ungated: HashMap<String, (String, Instant)>,
    /// When each namespace's quotas were last written.
    settled: HashMap<String, Instant>,
}

impl OwnWrites {
    /// Every cached quota (or our newer write of it), compacted; writes the cache has caught
    /// up with are forgotten.
    pub(super) fn working(&mut self, cached: &Cache<GpuQuota>) -> Working {
        let mut all = Vec::new();
        for q in cached.all() {
            let id = q.id();
            let newer = self
                .quotas
                .get(&id)
                .filter(|w| version(w) > version(&q))
                .cloned();
            if newer.is_none() {
                self.quotas.remove(&id);
            }
            let q = newer.unwrap_or_else(|| (*q).clone());
            match compact(&q, &BTreeSet::new(), Timestamp::now()) {
                Ok(c) => all.push(c),
                Err(e) => {
                    tracing::warn!(quota = %id, error = %e, "GpuQuota status cannot be summed; left out")
                }
            }
        }
        Working::new(all)
    }

    /// Writes the status of the decision's changed quotas of `ns`, remembering each write.
    pub(super) async fn write_quotas(
        &mut self,
        ns: &str,
        api: &Api<GpuQuota>,
        d: &Decision,
        metrics: &QueueMetrics,
    ) -> Result<(), QueueError> {
        for (q, changed) in &d.quotas {
            if !changed {
                continue;
            }
            self.settled.insert(ns.to_string(), Instant::now());
            let name = q.metadata.name.clone().unwrap_or_default();
            match api.replace_status(&name, &PostParams::default(), q).await {
                Ok(w) => {
                    metrics.status_write(false);
                    self.quotas.insert(w.id(), w);
                }
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    return Err(QueueError::Conflict(format!("{ns}/{name}")));
                }
                Err(e) => {
                    return Err(api_error(
                        "writing the status of GpuQuota",
                        &format!("{ns}/{name}"),
                        e,
                    ))
                }
            }
        }
        Ok(())
    }

    /// How much of `interval` is left since the quotas of `ns` were last written.
    pub(super) fn settle_wait(&self, ns: &str, interval: Duration) -> Option<Duration> {
        let elapsed = self.settled.get(ns)?.elapsed();
        interval.checked_sub(elapsed)
    }

    /// We removed the gate of pod `uid` and the cache may not show it yet.
    pub(super) fn is_ungated(&self, uid: &str) -> bool {
        self.ungated.contains_key(uid)
    }

    /// We removed (or found gone) the gate of pod `uid` of `ns`.
    pub(super) fn ungated(&mut self, uid: &str, ns: &str) {
        self.ungated
            .insert(uid.to_string(), (ns.to_string(), Instant::now()));
    }

    /// Forgets every ungate of `ns` whose pod the cache no longer shows gated (or that is a
    /// minute old: the cache missed it, so the gate is removed again).
    pub(super) fn forget_shown(&mut self, ns: &str, pods: &[Arc<Pod>]) {
        let gated: BTreeSet<&str> = pods
            .iter()
            .filter(|p| pods::gate_index(p).is_some())
            .filter_map(|p| p.metadata.uid.as_deref())
            .collect();
        // Only this namespace's marks: `gated` says nothing about other namespaces' pods.
        self.ungated.retain(|uid, (namespace, at)| {
            namespace != ns
                || (gated.contains(uid.as_str()) && at.elapsed() < Duration::from_secs(60))
        });
    }
}

fn version(q: &GpuQuota) -> u64 {
    q.metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
