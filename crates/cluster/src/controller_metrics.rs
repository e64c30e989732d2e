//! Metrics of the quota loop, `gpuplane_quota_*`: process totals (releases, cycles, status
//! writes) and, per GpuQuota (labels `namespace`, `quota`), pods released from the queue,
//! their wait from creation to release (histogram) and, read at scrape time, the queue's
//! length. And the explainer's (`crate::controller::explainer`), by reason: Pending GPU pods now
//! (`gpuplane_pending_gpu_pods`) and how long pods stayed explained
//! (`gpuplane_pending_gpu_pod_seconds`), and per node pool and resource the free GPUs and how
//! fragmented they are (`gpuplane_node_pool_free_gpus`, `gpuplane_node_pool_fragmentation_ratio`).
//! And the GPU-hours ledger's counters (`metrics/gpu_time.rs`).
//! In a registry of their own, which the webhook's `/metrics` renders when the loops run beside
//! it.

mod gpu_time;

pub use gpu_time::{label_name, MAX_SERIES};

use crate::metrics::{self, register, Histograms};
use gpu_time::GpuTime;
use gpuplane_model::controller::hours::{Series, Totals};
use gpuplane_model::explain::{PoolFragmentation, Reason};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Queue waits run from seconds to hours; the starvation bound defaults to 2 minutes.
const WAIT_BUCKETS: &[f64] = &[
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0,
];

fn wait_histogram() -> Histogram {
    Histogram::new(WAIT_BUCKETS.iter().copied())
}

/// The labels of a per-GpuQuota series.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct QuotaLabels {
    pub namespace: String,
    pub quota: String,
}

/// The label of a per-namespace series.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct NamespaceLabel {
    pub namespace: String,
}

/// The label of the explainer's series.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

fn reason_label(r: Reason) -> ReasonLabel {
    ReasonLabel {
        reason: r.as_str().into(),
    }
}

/// Per namespace: its GpuQuotas and how many of its pods wait; `gpuplane_quota_queue_length`
/// when scraped.
#[derive(Debug, Default)]
struct Waiting(Mutex<BTreeMap<String, (Vec<String>, u64)>>);

impl Waiting {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Vec<String>, u64)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Collector for Waiting {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let series: Vec<(QuotaLabels, i64)> = self
            .lock()
            .iter()
            .flat_map(|(ns, (quotas, n))| {
                quotas.iter().map(move |q| {
                    let labels = QuotaLabels {
                        namespace: ns.clone(),
                        quota: q.clone(),
                    };
                    (labels, i64::try_from(*n).unwrap_or(i64::MAX))
                })
            })
            .collect();
        metrics::gauges(
            &mut e,
            "gpuplane_quota_queue_length",
            "Gated pods waiting for the GpuQuotas of their namespace, by GpuQuota.",
            &series,
        )
    }
}

/// The labels of a per-pool series.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PoolLabels {
    pub pool: String,
    pub resource: String,
}

/// The pools as the explainer's last cycle saw them, rendered at scrape time (a pool that is
/// gone leaves no stale series).
#[derive(Debug, Default)]
struct Pools(Mutex<Vec<PoolFragmentation>>);

impl Collector for Pools {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let pools = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let labels = |p: &PoolFragmentation| PoolLabels {
            pool: p.pool.clone(),
            resource: p.resource.clone(),
        };
        let free: Vec<(PoolLabels, i64)> = pools
            .iter()
            .map(|p| (labels(p), i64::try_from(p.free).unwrap_or(i64::MAX)))
            .collect();
        let ratio: Vec<(PoolLabels, f64)> = pools.iter().map(|p| (labels(p), p.ratio)).collect();
        metrics::gauges(
            &mut e,
            "gpuplane_node_pool_free_gpus",
            "Free GPUs of Ready, uncordoned nodes, by node pool (nvidia.com/gpu.product) and resource",
            &free,
        )?;
        metrics::gauges(
            &mut e,
            "gpuplane_node_pool_fragmentation_ratio",
            "1 - the largest free on one node / free in the pool (0: all free GPUs on one node), by node pool and resource",
            &ratio,
        )
    }
}

/// Shared by the loops; cheap to update from any task.
#[derive(Debug)]
pub struct QueueMetrics {
    registry: Registry,
    pods_released: Counter,
    cycles: Counter,
    status_writes: Counter,
    status_conflicts: Counter,
    errors: Counter,
    released: Family<QuotaLabels, Counter>,
    preempted: Family<NamespaceLabel, Counter>,
    wait: Histograms<QuotaLabels>,
    waiting: Arc<Waiting>,
    pending: Family<ReasonLabel, Gauge>,
    pending_seconds: Histograms<ReasonLabel>,
    pools: Arc<Pools>,
    gpu_time: GpuTime,
}

impl Default for QueueMetrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let mut counter = |name: &str, help: &str| register(&mut r, name, help, Counter::default());
        let pods_released = counter(
            "gpuplane_quota_pods_released",
            "Pods whose scheduling gate the quota queue removed",
        );
        let cycles = counter(
            "gpuplane_quota_cycles",
            "Namespace reconciles run by the quota queue",
        );
        let status_writes = counter("gpuplane_quota_status_writes", "GpuQuota status writes");
        let status_conflicts = counter(
            "gpuplane_quota_status_conflicts",
            "GpuQuota status writes that hit a conflict (409)",
        );
        let errors = counter(
            "gpuplane_quota_reconcile_errors",
            "Namespace reconciles that failed and were retried",
        );
        let released = register(
            &mut r,
            "gpuplane_quota_released",
            "Pods released from the queue (their scheduling gate removed): Queue-mode admissions, by GpuQuota",
            Family::default(),
        );
        let preempted = register(
            &mut r,
            "gpuplane_quota_preempted_pods",
            "Pods evicted to make room for a waiting pod of higher priority or reclaiming a cohort's capacity (spec.preemption), by the evicted pod's namespace",
            Family::default(),
        );
        let wait = register(
            &mut r,
            "gpuplane_quota_wait_seconds",
            "Time from a queued pod's creation to its release, by GpuQuota",
            Histograms::new_with_constructor(wait_histogram as fn() -> Histogram),
        );
        let waiting = Arc::<Waiting>::default();
        r.register_collector(Box::new(waiting.clone()));
        let pending = register(
            &mut r,
            "gpuplane_pending_gpu_pods",
            "Pending, unscheduled GPU pods, by why they wait (gpuplane explain's reason)",
            Family::default(),
        );
        let pending_seconds = register(
            &mut r,
            "gpuplane_pending_gpu_pod_seconds",
            "Time from a Pending GPU pod's creation to its leaving Pending (scheduled or deleted), by its last reason",
            Histograms::new_with_constructor(wait_histogram as fn() -> Histogram),
        );
        let pools = Arc::<Pools>::default();
        r.register_collector(Box::new(pools.clone()));
        let gpu_time = GpuTime::register(&mut r);
        QueueMetrics {
            registry: r,
            pods_released,
            cycles,
            status_writes,
            status_conflicts,
            errors,
            released,
            preempted,
            wait,
            waiting,
            pending,
            pending_seconds,
            pools,
            gpu_time,
        }
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Pods whose gate was removed.
    pub released: u64,
    /// Pods waiting now, over all namespaces.
    pub waiting: u64,
    /// Namespace reconciles run.
    pub cycles: u64,
    /// GpuQuota status writes, and how many of them hit a conflict (409).
    pub status_writes: u64,
    pub status_conflicts: u64,
    /// Reconciles that failed (API errors; retried by the error policy).
    pub errors: u64,
}

impl QueueMetrics {
    /// A pod of `namespace`, whose GpuQuotas are `quotas`, was released after `waited`.
    pub fn released(&self, namespace: &str, quotas: &[String], waited: Duration) {
        self.pods_released.inc();
        for q in quotas {
            let at = QuotaLabels {
                namespace: namespace.to_string(),
                quota: q.clone(),
            };
            self.released.get_or_create(&at).inc();
            self.wait.get_or_create(&at).observe(waited.as_secs_f64());
        }
    }

    /// A pod of `namespace` was evicted to make room (preemption).
    pub fn preempted(&self, namespace: &str) {
        let at = NamespaceLabel {
            namespace: namespace.to_string(),
        };
        self.preempted.get_or_create(&at).inc();
    }

    pub fn cycle(&self) {
        self.cycles.inc();
    }

    pub fn status_write(&self, conflicted: bool) {
        self.status_writes.inc();
        if conflicted {
            self.status_conflicts.inc();
        }
    }

    pub fn error(&self) {
        self.errors.inc();
    }

    /// After a reconcile of `namespace`: `n` of its pods wait for its GpuQuotas `quotas`
    /// (none: the namespace is forgotten).
    pub fn set_waiting(&self, namespace: &str, quotas: Vec<String>, n: u64) {
        let mut w = self.waiting.lock();
        if quotas.is_empty() {
            w.remove(namespace);
        } else {
            w.insert(namespace.to_string(), (quotas, n));
        }
    }

    /// After an explainer cycle: how many pods wait for each reason (every reason is set, 0
    /// where none waits, so a series drops to 0 rather than going stale).
    pub fn set_pending(&self, counts: &BTreeMap<Reason, u64>) {
        for r in Reason::WAITING {
            let n = counts.get(&r).copied().unwrap_or(0);
            self.pending
                .get_or_create(&reason_label(r))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// After an explainer cycle: every node pool's free GPUs and fragmentation ratio.
    pub fn set_pools(&self, pools: Vec<PoolFragmentation>) {
        *self.pools.0.lock().unwrap_or_else(|p| p.into_inner()) = pools;
    }

    /// A pod left the explained set (scheduled or deleted) after `waited`, last for `reason`.
    pub fn left_pending(&self, reason: Reason, waited: Duration) {
        self.pending_seconds
            .get_or_create(&reason_label(reason))
            .observe(waited.as_secs_f64());
    }

    /// A flush of the GPU-hours book added `added` (owner values in `owner_keys` order).
    pub fn gpu_time(&self, owner_keys: &[String], added: &BTreeMap<Series, Totals>) {
        self.gpu_time.add(owner_keys, added);
    }

    /// The registry of every family above, the queue length included.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let waiting = self.waiting.lock().values().map(|(_, n)| n).sum();
        MetricsSnapshot {
            released: self.pods_released.get(),
            waiting,
            cycles: self.cycles.get(),
            status_writes: self.status_writes.get(),
            status_conflicts: self.status_conflicts.get(),
            errors: self.errors.get(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_totals_and_per_quota_series_as_openmetrics() {
        let m = QueueMetrics::default();
        let quotas = vec!["a".to_string(), "b".to_string()];
        m.released("team-a", &quotas, Duration::from_millis(1500));
        m.released("team-a", &quotas, Duration::from_secs(90));
        m.cycle();
        m.status_write(false);
        m.status_write(true);
        m.set_waiting("team-a", quotas, 3);
        m.set_waiting("team-b", vec!["q".into()], 0);
        m.set_waiting("team-c", vec!["q".into()], 5);
        m.set_waiting("team-c", Vec::new(), 0);
        m.set_pending(&BTreeMap::from([(Reason::Capacity, 2)]));
        m.left_pending(Reason::Placement, Duration::from_secs(20));
        m.set_pools(vec![
            PoolFragmentation {
                pool: "NVIDIA-H100".into(),
                resource: "nvidia.com/gpu".into(),
                free: 6,
                largest: 2,
                ratio: 1.0 - 2.0 / 6.0,
            },
            PoolFragmentation {
                pool: "unlabelled".into(),
                resource: "nvidia.com/gpu".into(),
                free: 0,
                largest: 0,
                ratio: 0.0,
            },
        ]);
        let text = metrics::render(&[m.registry()]);
        for line in [
            "# TYPE gpuplane_quota_pods_released counter",
            "gpuplane_quota_pods_released_total 2",
            "gpuplane_quota_cycles_total 1",
            "gpuplane_quota_status_writes_total 2",
            "gpuplane_quota_status_conflicts_total 1",
            "gpuplane_quota_reconcile_errors_total 0",
            "gpuplane_quota_released_total{namespace=\"team-a\",quota=\"b\"} 2",
            "# TYPE gpuplane_quota_wait_seconds histogram",
            "gpuplane_quota_wait_seconds_bucket{le=\"1.0\",namespace=\"team-a\",quota=\"a\"} 0",
            "gpuplane_quota_wait_seconds_bucket{le=\"5.0\",namespace=\"team-a\",quota=\"a\"} 1",
            "gpuplane_quota_wait_seconds_bucket{le=\"120.0\",namespace=\"team-a\",quota=\"a\"} 2",
            "gpuplane_quota_wait_seconds_bucket{le=\"7200.0\",namespace=\"team-a\",quota=\"a\"} 2",
            "gpuplane_quota_wait_seconds_bucket{le=\"+Inf\",namespace=\"team-a\",quota=\"a\"} 2",
            "gpuplane_quota_wait_seconds_sum{namespace=\"team-a\",quota=\"a\"} 91.5",
            "gpuplane_quota_wait_seconds_count{namespace=\"team-a\",quota=\"a\"} 2",
            "# TYPE gpuplane_quota_queue_length gauge",
            "gpuplane_quota_queue_length{namespace=\"team-a\",quota=\"a\"} 3",
            "gpuplane_quota_queue_length{namespace=\"team-b\",quota=\"q\"} 0",
            "# TYPE gpuplane_pending_gpu_pods gauge",
            "gpuplane_pending_gpu_pods{reason=\"Capacity\"} 2",
            "gpuplane_pending_gpu_pods{reason=\"NoGPUCapacity\"} 0",
            "gpuplane_pending_gpu_pod_seconds_bucket{le=\"30.0\",reason=\"Placement\"} 1",
            "gpuplane_pending_gpu_pod_seconds_count{reason=\"Placement\"} 1",
            "gpuplane_pending_gpu_pods{reason=\"Gang\"} 0",
            "# TYPE gpuplane_node_pool_free_gpus gauge",
            "gpuplane_node_pool_free_gpus{pool=\"NVIDIA-H100\",resource=\"nvidia.com/gpu\"} 6",
            "gpuplane_node_pool_fragmentation_ratio{pool=\"NVIDIA-H100\",resource=\"nvidia.com/gpu\"} 0.6666666666666667",
            "gpuplane_node_pool_fragmentation_ratio{pool=\"unlabelled\",resource=\"nvidia.com/gpu\"} 0.0",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing from:\n{text}"
            );
        }
        assert!(!text.contains("team-c"), "{text}");
        assert_eq!(
            m.snapshot(),
            MetricsSnapshot {
                released: 2,
                waiting: 3,
                cycles: 1,
                status_writes: 2,
                status_conflicts: 1,
                errors: 0,
            }
        );
    }
}
