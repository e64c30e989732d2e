//! Prometheus metrics of the webhook: its counters and decision latency in a registry of its
//! own (so replicas side by side in one process keep apart), and, computed at scrape time, the
//! group commit's counts, the usage of every GpuQuota as last seen, whether the API server
//! answers, and the quota loops' metrics when they run beside the webhook; one OpenMetrics
//! exposition ([`exposition`]).

use super::commit::CommitCounters;
use super::health::Probes;
use super::review::Verdict;
use crate::controller_metrics::{QueueMetrics, QuotaLabels};
use crate::elector::Role;
use crate::metrics::{self, latency, register, Histograms};
use crate::quota::{Amount, Dimension, GpuQuota};
use gpuplane_common::label_values;
use k8s_openapi::jiff::Timestamp;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

label_values! {
    /// Which webhook answered.
    pub enum Webhook {
        Validate => "validate",
        Mutate => "mutate",
    }
}

label_values! {
    /// How an AdmissionReview was answered.
    enum Answer {
        Allowed => "allowed",
        Patched => "patched",
        Denied => "denied",
        BadRequest => "bad_request",
        Error => "error",
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct AdmissionLabels {
    webhook: Webhook,
    result: Answer,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WebhookLabel {
    webhook: Webhook,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CodeLabel {
    code: u16,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    admissions: Family<AdmissionLabels, Counter>,
    decisions: Histograms<WebhookLabel>,
    rejected: Family<CodeLabel, Counter>,
    contended: Counter,
    quota_admissions: Family<QuotaLabels, Counter>,
    quota_denials: Family<QuotaLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::default();
        Metrics {
            admissions: register(
                &mut r,
                "gpuplane_webhook_admissions",
                "Admission requests answered, by webhook and result",
                Family::default(),
            ),
            decisions: register(
                &mut r,
                "gpuplane_webhook_decision_seconds",
                "Time from an AdmissionReview's arrival to its answer (body read, decision, encoding)",
                Histograms::new_with_constructor(latency as fn() -> Histogram),
            ),
            rejected: register(
                &mut r,
                "gpuplane_webhook_rejected_bodies",
                "Request bodies answered with an HTTP error, by code",
                Family::default(),
            ),
            contended: register(
                &mut r,
                "gpuplane_webhook_reservation_contended",
                "Reservations given up after too many write conflicts",
                Counter::default(),
            ),
            quota_admissions: register(
                &mut r,
                "gpuplane_quota_admissions",
                "Pods and claims the webhook reserved quota for, by GpuQuota (Queue-mode admissions are gpuplane_quota_released_total)",
                Family::default(),
            ),
            quota_denials: register(
                &mut r,
                "gpuplane_quota_denials",
                "Pods and claims denied because they did not fit, by GpuQuota",
                Family::default(),
            ),
            registry: r,
        }
    }
}

fn quota_labels(namespace: &str, quota: &str) -> QuotaLabels {
    QuotaLabels {
        namespace: namespace.to_string(),
        quota: quota.to_string(),
    }
}

impl Metrics {
    pub fn admission(&self, webhook: Webhook, v: &Verdict) {
        let result = match (v.allowed, v.patch.0.is_empty(), v.code) {
            (true, true, _) => Answer::Allowed,
            (true, false, _) => Answer::Patched,
            (false, _, 403) => Answer::Denied,
            (false, _, 400) => Answer::BadRequest,
            (false, _, _) => Answer::Error,
        };
        self.admissions
            .get_or_create(&AdmissionLabels { webhook, result })
            .inc();
    }

    /// One AdmissionReview answered by `webhook` after `took`.
    pub fn decided(&self, webhook: Webhook, took: Duration) {
        self.decisions
            .get_or_create(&WebhookLabel { webhook })
            .observe(took.as_secs_f64());
    }

    pub fn rejected_body(&self, code: u16) {
        self.rejected.get_or_create(&CodeLabel { code }).inc();
    }

    pub fn contended(&self) {
        self.contended.inc();
    }

    /// A reservation was written to GpuQuota `namespace/quota`.
    pub fn quota_admitted(&self, namespace: &str, quota: &str) {
        self.quota_admissions
            .get_or_create(&quota_labels(namespace, quota))
            .inc();
    }

    /// GpuQuota `namespace/quota` did not have room.
    pub fn quota_denied(&self, namespace: &str, quota: &str) {
        self.quota_denials
            .get_or_create(&quota_labels(namespace, quota))
            .inc();
    }

    /// The webhook's own counters and histograms, as an exposition of their own.
    pub fn render(&self) -> String {
        metrics::render(&[&self.registry])
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

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResourceLabels {
    namespace: String,
    quota: String,
    resource: String,
}

type Series = Vec<(ResourceLabels, f64)>;

/// `gpuplane_quota_{hard,used,reserved}{namespace,quota,resource}` of `quotas`: hard for each
/// limited dimension; used and reserved for gpus, gpuMemory and every device name the quota
/// limits or holds. `resource` is spelled as in denial messages (`gpus`, `gpuMemory`,
/// `devices[nvidia.com/gpu]`).
fn quota_series(quotas: &[Arc<GpuQuota>]) -> [Series; 3] {
    let mut sorted: Vec<&GpuQuota> = quotas.iter().map(|q| &**q).collect();
    sorted.sort_by_key(|q| q.id());
    let [mut hard, mut used, mut reserved] = [Vec::new(), Vec::new(), Vec::new()];
    let now = Timestamp::now();
    for q in sorted {
        let at = |d: &Dimension| ResourceLabels {
            namespace: q.metadata.namespace.clone().unwrap_or_default(),
            quota: q.metadata.name.clone().unwrap_or_default(),
            resource: d.to_string(),
        };
        // The bound in force: temporary raises included while they last.
        for (d, a) in q.spec.in_force(now).hard.bounds() {
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
    [hard, used, reserved]
}

/// What the webhook reports beside its own families, read when `/metrics` is scraped.
#[derive(Debug)]
struct Scraped {
    /// The group commit's batches, status writes, their conflicts and escrowed admissions.
    commits: [u64; 4],
    quotas: [Series; 3],
    api_reachable: bool,
    /// Whether this replica leads, when it runs the quota loops.
    leading: Option<bool>,
}

impl Collector for Scraped {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let [batches, writes, conflicts, escrowed] = self.commits;
        metrics::counter(
            &mut e,
            "gpuplane_webhook_commit_batches",
            "Batches of admissions decided together for one GpuQuota.",
            batches,
        )?;
        metrics::counter(
            &mut e,
            "gpuplane_webhook_status_writes",
            "GpuQuota status writes by the webhook (group commits, escrow flushes and refills).",
            writes,
        )?;
        metrics::counter(
            &mut e,
            "gpuplane_webhook_status_conflicts",
            "Webhook GpuQuota status writes answered 409 Conflict (decided again).",
            conflicts,
        )?;
        metrics::counter(
            &mut e,
            "gpuplane_webhook_escrow_admissions",
            "Admissions made within this replica's escrow, with no status write waited for.",
            escrowed,
        )?;
        let [hard, used, reserved] = &self.quotas;
        metrics::gauges(
            &mut e,
            "gpuplane_quota_hard",
            "A GpuQuota's limit per resource (gpus: GPU equivalents, gpuMemory: bytes, devices[..]: count).",
            hard,
        )?;
        metrics::gauges(
            &mut e,
            "gpuplane_quota_used",
            "What running pods and allocated claims hold of a GpuQuota, per resource, as last seen.",
            used,
        )?;
        metrics::gauges(
            &mut e,
            "gpuplane_quota_reserved",
            "What admitted, not yet running pods and claims hold of a GpuQuota, per resource, as last seen.",
            reserved,
        )?;
        metrics::gauge(
            &mut e,
            "gpuplane_controller_api_reachable",
            "1 while the API server answered a probe within the bound; 0 while the webhook answers from its last known state.",
            i64::from(self.api_reachable),
        )?;
        if let Some(leading) = self.leading {
            metrics::gauge(
                &mut e,
                "gpuplane_controller_leader",
                "1 while this replica holds the Lease and runs the quota loops.",
                i64::from(leading),
            )?;
        }
        Ok(())
    }
}

/// Everything `/metrics` serves.
pub fn exposition(
    metrics: &Metrics,
    quotas: &[Arc<GpuQuota>],
    probes: &Probes,
    commits: &CommitCounters,
    loops: Option<&QueueMetrics>,
) -> String {
    let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let scraped = Scraped {
        commits: [
            read(&commits.batches),
            read(&commits.writes),
            read(&commits.conflicts),
            read(&commits.escrowed),
        ],
        quotas: quota_series(quotas),
        api_reachable: probes.api_reachable(),
        leading: probes.view().role.map(|r| r == Role::Leader),
    };
    let mut scrape = Registry::default();
    scrape.register_collector(Box::new(scraped));
    let mut registries = vec![&metrics.registry, &scrape];
    registries.extend(loops.map(QueueMetrics::registry));
    metrics::render(&registries)
}
