//! Prometheus metrics of the webhook (text exposition format): its counters and decision
//! latency in a registry of its own (so replicas side by side in one process keep apart), and,
//! computed at scrape time, the usage of every GpuQuota as last seen, whether the API server
//! answers, and the quota loops' metrics when they run beside the webhook.

use super::commit::CommitCounters;
use super::probe::Probes;
use super::review::Verdict;
use crate::controller::elector::Role;
use crate::controller::metrics::QueueMetrics;
use crate::metrics::{labels, render_counters, render_gauges, Registry};
use crate::quota::{Amount, Dimension, GpuQuota};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

const ADMISSIONS: &str = "gpuplane_webhook_admissions_total";
const ADMISSIONS_HELP: &str = "Admission requests answered, by webhook and result.";
const DECISIONS: &str = "gpuplane_webhook_decision_seconds";
const DECISIONS_HELP: &str =
    "Time from an AdmissionReview's arrival to its answer (body read, decision, encoding).";
const REJECTED: &str = "gpuplane_webhook_rejected_bodies_total";
const REJECTED_HELP: &str = "Request bodies answered with an HTTP error, by code.";
const CONTENDED: &str = "gpuplane_webhook_reservation_contended_total";
const CONTENDED_HELP: &str = "Reservations given up after too many write conflicts.";
const QUOTA_ADMISSIONS: &str = "gpuplane_quota_admissions_total";
const QUOTA_ADMISSIONS_HELP: &str =
    "Pods and claims the webhook reserved quota for, by GpuQuota (Queue-mode admissions are gpuplane_quota_released_total).";
const QUOTA_DENIALS: &str = "gpuplane_quota_denials_total";
const QUOTA_DENIALS_HELP: &str = "Pods and claims denied because they did not fit, by GpuQuota.";

#[derive(Debug, Default)]
pub struct Metrics {
    registry: Registry,
}

impl Metrics {
    pub fn admission(&self, webhook: &'static str, v: &Verdict) {
        let result = match (v.allowed, v.patch.is_empty(), v.code) {
            (true, true, _) => "allowed",
            (true, false, _) => "patched",
            (false, _, 403) => "denied",
            (false, _, 400) => "bad_request",
            (false, _, _) => "error",
        };
        self.registry.inc(
            ADMISSIONS,
            ADMISSIONS_HELP,
            &[("webhook", webhook), ("result", result)],
        );
    }

    /// One AdmissionReview answered by `webhook` (`validate` or `mutate`) after `took`.
    pub fn decided(&self, webhook: &'static str, took: Duration) {
        self.registry.observe(
            DECISIONS,
            DECISIONS_HELP,
            &[("webhook", webhook)],
            took.as_secs_f64(),
        );
    }

    pub fn rejected_body(&self, code: u16) {
        self.registry
            .inc(REJECTED, REJECTED_HELP, &[("code", &code.to_string())]);
    }

    pub fn contended(&self) {
        self.registry.inc(CONTENDED, CONTENDED_HELP, &[]);
    }

    /// A reservation was written to GpuQuota `namespace/quota`.
    pub fn quota_admitted(&self, namespace: &str, quota: &str) {
        self.registry.inc(
            QUOTA_ADMISSIONS,
            QUOTA_ADMISSIONS_HELP,
            &[("namespace", namespace), ("quota", quota)],
        );
    }

    /// GpuQuota `namespace/quota` did not have room.
    pub fn quota_denied(&self, namespace: &str, quota: &str) {
        self.registry.inc(
            QUOTA_DENIALS,
            QUOTA_DENIALS_HELP,
            &[("namespace", namespace), ("quota", quota)],
        );
    }

    /// The webhook's own counters and histograms.
    pub fn render(&self) -> String {
        self.registry.render()
    }
}

/// An amount as a Prometheus value: GPUs as a decimal, memory in bytes, devices as a count.
fn value(a: Amount) -> f64 {
    match a {
        Amount::Gpus(g) => g.numer() as f64 / g.denom() as f64,
        Amount::Memory(m) => m.bytes() as f64,
        Amount::Count(c) => c as f64,
    }
}

/// `gpuplane_quota_{hard,used,reserved}{namespace,quota,resource}` of `quotas`: hard for each
/// limited dimension; used and reserved for gpus, gpuMemory and every device name the quota
/// limits or holds. `resource` is spelled as in denial messages (`gpus`, `gpuMemory`,
/// `devices[nvidia.com/gpu]`).
pub fn quota_gauges(quotas: &[Arc<GpuQuota>]) -> String {
    let mut sorted: Vec<&GpuQuota> = quotas.iter().map(|q| &**q).collect();
    sorted.sort_by_key(|q| q.id());
    let mut hard = Vec::new();
    let mut used = Vec::new();
    let mut reserved = Vec::new();
    for q in sorted {
        let ns = q.metadata.namespace.as_deref().unwrap_or("");
        let name = q.metadata.name.as_deref().unwrap_or("");
        let at = |d: &Dimension| {
            labels(&[
                ("namespace", ns),
                ("quota", name),
                ("resource", &d.to_string()),
            ])
        };
        for (d, a) in q.spec.hard.bounds() {
            hard.push((at(&d), value(a)));
        }
        let status = q.status_or_default();
        let devices: BTreeSet<&String> = q
            .spec
            .hard
            .devices
            .keys()
            .chain(status.used.devices.keys())
            .chain(status.reserved.devices.keys())
            .collect();
        let dims = [Dimension::Gpus, Dimension::GpuMemory]
            .into_iter()
            .chain(devices.into_iter().map(|d| Dimension::Devices(d.clone())));
        for d in dims {
            used.push((at(&d), value(status.used.get(&d))));
            reserved.push((at(&d), value(status.reserved.get(&d))));
        }
    }
    render_gauges(&[
        (
            "gpuplane_quota_hard",
            "A GpuQuota's limit per resource (gpus: GPU equivalents, gpuMemory: bytes, devices[..]: count).",
            hard,
        ),
        (
            "gpuplane_quota_used",
            "What running pods and allocated claims hold of a GpuQuota, per resource, as last seen.",
            used,
        ),
        (
            "gpuplane_quota_reserved",
            "What admitted, not yet running pods and claims hold of a GpuQuota, per resource, as last seen.",
            reserved,
        ),
    ])
}

/// Everything `/metrics` serves.
/// The group commit's counts: batches, GpuQuota status writes and their conflicts, and the
/// admissions made within an escrow (no write waited for).
fn commit_counters(c: &CommitCounters) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    let one = |v: &std::sync::atomic::AtomicU64| vec![(String::new(), v.load(Relaxed) as f64)];
    render_counters(&[
        (
            "gpuplane_webhook_commit_batches_total",
            "Batches of admissions decided together for one GpuQuota.",
            one(&c.batches),
        ),
        (
            "gpuplane_webhook_status_writes_total",
            "GpuQuota status writes by the webhook (group commits, escrow flushes and refills).",
            one(&c.writes),
        ),
        (
            "gpuplane_webhook_status_conflicts_total",
            "Webhook GpuQuota status writes answered 409 Conflict (decided again).",
            one(&c.conflicts),
        ),
        (
            "gpuplane_webhook_escrow_admissions_total",
            "Admissions made within this replica's escrow, with no status write waited for.",
            one(&c.escrowed),
        ),
    ])
}

pub fn exposition(
    metrics: &Metrics,
    quotas: &[Arc<GpuQuota>],
    probes: &Probes,
    commits: &CommitCounters,
    loops: Option<&QueueMetrics>,
) -> String {
    let mut out = metrics.render();
    out.push_str(&commit_counters(commits));
    out.push_str(&quota_gauges(quotas));
    let view = probes.view();
    let reachable = if probes.api_reachable() { 1.0 } else { 0.0 };
    let mut gauges = vec![(
        "gpuplane_controller_api_reachable",
        "1 while the API server answered a probe within the bound; 0 while the webhook answers from its last known state.",
        vec![(String::new(), reachable)],
    )];
    if let Some(role) = view.role {
        let leading = if role == Role::Leader { 1.0 } else { 0.0 };
        gauges.push((
            "gpuplane_controller_leader",
            "1 while this replica holds the Lease and runs the quota loops.",
            vec![(String::new(), leading)],
        ));
    }
    out.push_str(&render_gauges(&gauges));
    if let Some(l) = loops {
        out.push_str(&l.render());
    }
    out
}
