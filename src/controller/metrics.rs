//! Counters of the controller loops, kept for a later Prometheus export (`gpuplane_quota_*`).

use std::collections::BTreeMap;
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

impl QueueMetrics {
    pub fn released(&self, waited: Duration) {
        self.released.fetch_add(1, Ordering::Relaxed);
        let ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        self.wait_millis.fetch_add(ms, Ordering::Relaxed);
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

    /// Pods waiting in `namespace` after its last reconcile.
    pub fn set_waiting(&self, namespace: &str, n: u64) {
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if n == 0 {
            w.remove(namespace);
        } else {
            w.insert(namespace.to_string(), n);
        }
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
