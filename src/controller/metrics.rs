//! Counters of the controller loops, exported in Prometheus text as `gpuplane_quota_*`.
//!
//! Every update is also added to one process-wide copy ([`QueueMetrics::process`]), which the
//! webhook's `/metrics` endpoint renders next to its own counters: the controller and the
//! webhook share a process (`gpuplane controller`) but are started separately.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Shared by the loops; cheap to update from any task.
#[derive(Debug, Default)]
pub struct QueueMetrics {
    released: AtomicU64,
    wait_millis: AtomicU64,
    cycles: AtomicU64,
    status_writes: AtomicU64,
    status_conflicts: AtomicU64,
    errors: AtomicU64,
    waiting: Mutex<BTreeMap<String, u64>>,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Pods whose gate was removed.
    pub released: u64,
    /// Sum over released pods of creation-to-release time.
    pub wait_total: Duration,
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

/// The process-wide copy: every instance's updates are added here too.
static PROCESS: QueueMetrics = QueueMetrics::new();

impl QueueMetrics {
    pub const fn new() -> QueueMetrics {
        QueueMetrics {
            released: AtomicU64::new(0),
            wait_millis: AtomicU64::new(0),
            cycles: AtomicU64::new(0),
            status_writes: AtomicU64::new(0),
            status_conflicts: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            waiting: Mutex::new(BTreeMap::new()),
        }
    }

    /// The sum of every instance's updates in this process (what `/metrics` serves).
    pub fn process() -> &'static QueueMetrics {
        &PROCESS
    }

    /// Applies `f` to this instance and, unless it is the process-wide one, to that too.
    fn each(&self, f: impl Fn(&QueueMetrics)) {
        f(self);
        if !std::ptr::eq(self, &PROCESS) {
            f(&PROCESS);
        }
    }

    pub fn released(&self, waited: Duration) {
        let ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        self.each(|m| {
            m.released.fetch_add(1, Ordering::Relaxed);
            m.wait_millis.fetch_add(ms, Ordering::Relaxed);
        });
    }

    pub fn cycle(&self) {
        self.each(|m| {
            m.cycles.fetch_add(1, Ordering::Relaxed);
        });
    }

    pub fn status_write(&self, conflicted: bool) {
        self.each(|m| {
            m.status_writes.fetch_add(1, Ordering::Relaxed);
            if conflicted {
                m.status_conflicts.fetch_add(1, Ordering::Relaxed);
            }
        });
    }

    pub fn error(&self) {
        self.each(|m| {
            m.errors.fetch_add(1, Ordering::Relaxed);
        });
    }

    /// Pods waiting in `namespace` after its last reconcile.
    pub fn set_waiting(&self, namespace: &str, n: u64) {
        self.each(|m| {
            let mut w = m.waiting.lock().unwrap_or_else(|p| p.into_inner());
            if n == 0 {
                w.remove(namespace);
            } else {
                w.insert(namespace.to_string(), n);
            }
        });
    }

    /// The counters in Prometheus text format. Waiting pods are per namespace (the queue keeps
    /// no per-GpuQuota figures); the rest are totals.
    pub fn render(&self) -> String {
        let m = self.snapshot();
        let mut s = String::new();
        let mut one = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(s, "# HELP {name} {help}");
            let _ = writeln!(s, "# TYPE {name} {kind}");
            let _ = writeln!(s, "{name} {value}");
        };
        one(
            "gpuplane_quota_pods_released_total",
            "counter",
            "Pods whose scheduling gate the quota queue removed.",
            m.released.to_string(),
        );
        one(
            "gpuplane_quota_wait_seconds_total",
            "counter",
            "Sum over released pods of the time from creation to release.",
            format!("{:.3}", m.wait_total.as_secs_f64()),
        );
        one(
            "gpuplane_quota_cycles_total",
            "counter",
            "Namespace reconciles run by the quota queue.",
            m.cycles.to_string(),
        );
        one(
            "gpuplane_quota_status_writes_total",
            "counter",
            "GpuQuota status writes.",
            m.status_writes.to_string(),
        );
        one(
            "gpuplane_quota_status_conflicts_total",
            "counter",
            "GpuQuota status writes that hit a conflict (409).",
            m.status_conflicts.to_string(),
        );
        one(
            "gpuplane_quota_reconcile_errors_total",
            "counter",
            "Namespace reconciles that failed and were retried.",
            m.errors.to_string(),
        );
        let _ = writeln!(
            s,
            "# HELP gpuplane_quota_pods_waiting Gated pods waiting for quota, by namespace."
        );
        let _ = writeln!(s, "# TYPE gpuplane_quota_pods_waiting gauge");
        for (ns, n) in self
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(s, "gpuplane_quota_pods_waiting{{namespace=\"{ns}\"}} {n}");
        }
        s
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let waiting = self
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .sum();
        MetricsSnapshot {
            released: self.released.load(Ordering::Relaxed),
            wait_total: Duration::from_millis(self.wait_millis.load(Ordering::Relaxed)),
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
    fn renders_the_counters_in_prometheus_text_and_adds_them_to_the_process_copy() {
        let before = QueueMetrics::process().snapshot();
        let m = QueueMetrics::new();
        m.released(Duration::from_millis(1500));
        m.released(Duration::from_millis(500));
        m.cycle();
        m.status_write(false);
        m.status_write(true);
        m.set_waiting("team-a", 3);
        m.set_waiting("team-b", 0);
        let text = m.render();
        for line in [
            "# TYPE gpuplane_quota_pods_released_total counter",
            "gpuplane_quota_pods_released_total 2\n",
            "gpuplane_quota_wait_seconds_total 2.000\n",
            "gpuplane_quota_cycles_total 1\n",
            "gpuplane_quota_status_writes_total 2\n",
            "gpuplane_quota_status_conflicts_total 1\n",
            "gpuplane_quota_reconcile_errors_total 0\n",
            "# TYPE gpuplane_quota_pods_waiting gauge",
            "gpuplane_quota_pods_waiting{namespace=\"team-a\"} 3\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(!text.contains("team-b"), "{text}");
        // Other tests may update the process copy at the same time: at least ours are there.
        let after = QueueMetrics::process().snapshot();
        assert!(after.released >= before.released + 2, "{after:?}");
        assert!(
            after.status_conflicts > before.status_conflicts,
            "{after:?}"
        );
        assert!(QueueMetrics::process()
            .render()
            .contains("gpuplane_quota_pods_waiting{namespace=\"team-a\"} 3\n"));
    }
}
