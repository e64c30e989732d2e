//! Metrics of the quota loop, exported in Prometheus text as `gpuplane_quota_*`: process
//! totals (releases, cycles, status writes) and, per GpuQuota (labels `namespace`, `quota`),
//! pods released from the queue, their wait from creation to release (histogram) and the
//! queue's length. The webhook's `/metrics` renders them when the loops run beside it.

use crate::metrics::{labels, render_gauges, Registry};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

const RELEASED: &str = "gpuplane_quota_released_total";
const RELEASED_HELP: &str =
    "Pods released from the queue (their scheduling gate removed): Queue-mode admissions, by GpuQuota.";
const WAIT: &str = "gpuplane_quota_wait_seconds";
const WAIT_HELP: &str = "Time from a queued pod's creation to its release, by GpuQuota.";
/// Queue waits run from seconds to hours; the starvation bound defaults to 2 minutes.
const WAIT_BUCKETS: &[f64] = &[
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0,
];

/// Shared by the loops; cheap to update from any task.
#[derive(Debug, Default)]
pub struct QueueMetrics {
    released: AtomicU64,
    cycles: AtomicU64,
    status_writes: AtomicU64,
    status_conflicts: AtomicU64,
    errors: AtomicU64,
    /// Per namespace: its GpuQuotas and how many of its pods wait.
    waiting: Mutex<BTreeMap<String, (Vec<String>, u64)>>,
    /// The per-GpuQuota counters and histograms.
    registry: Registry,
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
        self.released.fetch_add(1, Ordering::Relaxed);
        for q in quotas {
            let at = [("namespace", namespace), ("quota", q.as_str())];
            self.registry.inc(RELEASED, RELEASED_HELP, &at);
            self.registry
                .observe_in(WAIT, WAIT_HELP, &at, waited.as_secs_f64(), WAIT_BUCKETS);
        }
    }

    pub fn cycle(&self) {
        self.cycles.fetch_add(1, Ordering::Relaxed);
    }

    pub fn status_write(&self, conflicted: bool) {
        self.status_writes.fetch_add(1, Ordering::Relaxed);
        if conflicted {
            self.status_conflicts.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// After a reconcile of `namespace`: `n` of its pods wait for its GpuQuotas `quotas`
    /// (none: the namespace is forgotten).
    pub fn set_waiting(&self, namespace: &str, quotas: Vec<String>, n: u64) {
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if quotas.is_empty() {
            w.remove(namespace);
        } else {
            w.insert(namespace.to_string(), (quotas, n));
        }
    }

    /// Everything in Prometheus text format.
    pub fn render(&self) -> String {
        let m = self.snapshot();
        let mut s = String::new();
        let mut one = |name: &str, help: &str, value: u64| {
            let _ = writeln!(s, "# HELP {name} {help}");
            let _ = writeln!(s, "# TYPE {name} counter");
            let _ = writeln!(s, "{name} {value}");
        };
        one(
            "gpuplane_quota_pods_released_total",
            "Pods whose scheduling gate the quota queue removed.",
            m.released,
        );
        one(
            "gpuplane_quota_cycles_total",
            "Namespace reconciles run by the quota queue.",
            m.cycles,
        );
        one(
            "gpuplane_quota_status_writes_total",
            "GpuQuota status writes.",
            m.status_writes,
        );
        one(
            "gpuplane_quota_status_conflicts_total",
            "GpuQuota status writes that hit a conflict (409).",
            m.status_conflicts,
        );
        one(
            "gpuplane_quota_reconcile_errors_total",
            "Namespace reconciles that failed and were retried.",
            m.errors,
        );
        s.push_str(&self.registry.render());
        let series: Vec<(String, f64)> = self
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .flat_map(|(ns, (quotas, n))| {
                quotas.iter().map(move |q| {
                    (
                        labels(&[("namespace", ns.as_str()), ("quota", q.as_str())]),
                        *n as f64,
                    )
                })
            })
            .collect();
        s.push_str(&render_gauges(&[(
            "gpuplane_quota_queue_length",
            "Gated pods waiting for the GpuQuotas of their namespace, by GpuQuota.",
            series,
        )]));
        s
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let waiting = self
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|(_, n)| n)
            .sum();
        MetricsSnapshot {
            released: self.released.load(Ordering::Relaxed),
            waiting,
            cycles: self.cycles.load(Ordering::Relaxed),
            status_writes: self.status_writes.load(Ordering::Relaxed),
            status_conflicts: self.status_conflicts.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_totals_and_per_quota_series_in_prometheus_text() {
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
        let text = m.render();
        for line in [
            "# TYPE gpuplane_quota_pods_released_total counter",
            "gpuplane_quota_pods_released_total 2\n",
            "gpuplane_quota_cycles_total 1\n",
            "gpuplane_quota_status_writes_total 2\n",
            "gpuplane_quota_status_conflicts_total 1\n",
            "gpuplane_quota_reconcile_errors_total 0\n",
            "gpuplane_quota_released_total{namespace=\"team-a\",quota=\"b\"} 2\n",
            "gpuplane_quota_wait_seconds_bucket{namespace=\"team-a\",quota=\"a\",le=\"5\"} 1\n",
            "gpuplane_quota_wait_seconds_bucket{namespace=\"team-a\",quota=\"a\",le=\"120\"} 2\n",
            "gpuplane_quota_wait_seconds_sum{namespace=\"team-a\",quota=\"a\"} 91.5\n",
            "# TYPE gpuplane_quota_queue_length gauge",
            "gpuplane_quota_queue_length{namespace=\"team-a\",quota=\"a\"} 3\n",
            "gpuplane_quota_queue_length{namespace=\"team-b\",quota=\"q\"} 0\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(!text.contains("team-c"), "{text}");
        assert_eq!(m.snapshot().waiting, 3);
    }
}
