//! The quota loop (I/O shell): watches pods, GpuQuotas, ResourceClaims and templates into
//! [`Cache`](super::cache::Cache)s, reads the published devices from the shared
//! [`Devices`], and reconciles each namespace that changed (or whose time came) with
//! [`namespace::decide`], then applies the decision: GpuQuota status first (PUT `/status` with the resourceVersion just read; a 409 lists and
//! decides the namespace again at once, a few times, then backs off), gates second, notes
//! (conditions and Events) last.
//!
//! [`QueueLoop::drive`] is the core: it takes the caches' input as a channel and a stop
//! signal, not watchers, so tests can feed it. [`run`] wires the real watchers to it.
//!
//! Reconciles are idempotent: each one reads the quotas afresh and decides from what is, so a
//! lost cycle, a restart or a new leader just decides again. Errors go through
//! [`error_policy`], which says when to try the namespace again.

mod error;
mod namespaces;
mod own_writes;
mod pod_writes;
mod preempt;
mod quota_events;
mod watched;

pub use super::watchers::{spawn_watchers, Input};
pub use error::{error_policy, QueueError};
pub use preempt::PREEMPTED_CONDITION;

use super::meter::{HoursOptions, Meter, Pricing};
use super::namespace::{self, Decision, Inputs, QueueSettings};
use super::pods;
use super::quota_ledger::Working;
use super::schedule::{drive, Keyed, Timing};
use crate::controller_metrics::QueueMetrics;
use crate::published::Devices;
use crate::quota::{CatalogSettings, GpuQuota, QuotaMode};
use error::api_error;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::watcher::Event;
use namespaces::Namespaces;
use own_writes::OwnWrites;
use preempt::Evictions;
use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;
use tokio::time::Instant;
use watched::Watched;

/// A namespace whose status write conflicted is decided again at once this many times before
/// its retry waits for [`error_policy`].
const CONFLICT_RETRIES: u32 = 8;

/// Tunables of the loop.
#[derive(Debug, Clone)]
pub struct QueueOptions {
    pub settings: QueueSettings,
    pub catalog: CatalogSettings,
    /// Changes arriving within this window are handled in one cycle.
    pub batch: Duration,
    /// Every namespace is reconciled at least this often.
    pub resync: Duration,
    /// A waiting pod's condition is rewritten at most this often when only its numbers change.
    pub note_refresh: Duration,
    /// API writes in flight at once.
    pub concurrency: usize,
    /// Condition and Event writes per namespace and cycle (releases are never capped).
    pub notes_per_cycle: usize,
    /// `reportingInstance` of Events (the replica's identity).
    pub instance: String,
    /// A namespace's quotas are rewritten at most this often when the write would only settle
    /// usage (count pods in `used`, drop their reservations, expire stale ones): each status
    /// write of the custom resource costs the API server milliseconds of CPU, and what is
    /// settled late is still counted (as a reservation or an escrow). Queue releases are
    /// never held back.
    pub settle_interval: Duration,
    /// The GPU-hours ledger, flushed by this loop (`None`: off).
    pub hours: Option<HoursOptions>,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            settings: QueueSettings::default(),
            catalog: CatalogSettings::default(),
            batch: Duration::from_millis(50),
            resync: Duration::from_secs(60),
            note_refresh: Duration::from_secs(30),
            concurrency: 64,
            notes_per_cycle: 500,
            instance: "gpuplane-controller".into(),
            settle_interval: Duration::from_millis(500),
            hours: None,
        }
    }
}

/// The loop: its parts, each owning its state, and the cycle that runs them.
pub struct QueueLoop {
    client: kube::Client,
    opts: QueueOptions,
    metrics: Arc<QueueMetrics>,
    /// What the watches show (`queue/watched.rs`).
    watched: Watched,
    /// What we wrote that the watches have not shown yet (`queue/own_writes.rs`).
    own_writes: OwnWrites,
    /// Each namespace's memory between cycles (`queue/namespaces.rs`).
    namespaces: Namespaces,
    /// Our evictions and the ones budgets refused (`queue/preempt.rs`).
    evictions: Evictions,
    /// The GPU-hours ledger (`None`: off).
    meter: Option<Meter>,
}

impl QueueLoop {
    /// A loop reading `devices`, which must have listed once (see [`Devices::ready`]).
    pub fn new(
        client: kube::Client,
        opts: QueueOptions,
        devices: Arc<Devices>,
        metrics: Arc<QueueMetrics>,
    ) -> QueueLoop {
        let meter = opts.hours.clone().map(Meter::new);
        QueueLoop {
            client,
            opts,
            metrics,
            watched: Watched::new(devices),
            own_writes: OwnWrites::default(),
            namespaces: Namespaces::default(),
            evictions: Evictions::default(),
            meter,
        }
    }

    /// Applies one input; returns the namespaces to reconcile because of it.
    fn apply(&mut self, input: Input) -> BTreeSet<String> {
        match &input {
            Input::Pod(e) => {
                if let (Some(m), Event::Delete(p)) = (self.meter.as_mut(), &**e) {
                    let w = &self.watched;
                    let templates = |ns: &str| w.template_specs(ns);
                    m.deleted(
                        p,
                        &Pricing {
                            catalog: w.catalog(),
                            templates: &templates,
                        },
                    );
                }
            }
            // A pod's charge may come from its templates.
            Input::Template(_) => self.reprice(),
            _ => {}
        }
        self.watched.apply(input)
    }

    /// Runs until `stop` resolves or the input ends.
    pub async fn drive(&mut self, inputs: mpsc::Receiver<Input>, stop: impl Future<Output = ()>) {
        let timing = Timing {
            batch: self.opts.batch,
            resync: self.opts.resync,
            // Sooner than a deadline already set (a reservation's grace, minutes away), never
            // later than one that is near.
            sooner: true,
        };
        drive(self, inputs, timing, stop).await;
    }

    /// Pods are priced again (templates or the catalog changed).
    fn reprice(&mut self) {
        self.namespaces.reprice();
        if let Some(m) = self.meter.as_mut() {
            m.reprice();
        }
    }

    fn refresh_catalog(&mut self) {
        if self.watched.refresh_catalog() {
            self.reprice();
        }
    }

    /// Flushes the GPU-hours book; the namespaces whose quotas' totals grew.
    async fn flush_hours(&mut self) -> BTreeSet<String> {
        self.refresh_catalog();
        let Some(mut m) = self.meter.take() else {
            return BTreeSet::new();
        };
        let w = &self.watched;
        let pods: Vec<_> = w.pods.all().collect();
        let quotas: Vec<_> = w.quotas.all().collect();
        let templates = |ns: &str| w.template_specs(ns);
        let pricing = Pricing {
            catalog: w.catalog(),
            templates: &templates,
        };
        let touched = m
            .flush(&self.client, &pods, &quotas, &pricing, &self.metrics)
            .await;
        self.meter = Some(m);
        touched
    }

    /// Reconciles `namespaces`; returns when each wants to run again.
    pub async fn cycle(&mut self, namespaces: &[String]) -> Vec<(String, Instant)> {
        self.refresh_catalog();
        let mut working = self.own_writes.working(&self.watched.quotas);
        let mut again = Vec::new();
        for ns in namespaces {
            match self.reconcile(ns, SystemTime::now(), &mut working).await {
                Ok(next) => {
                    self.namespaces.succeeded(ns);
                    if let Some(t) = next {
                        let wait = t
                            .duration_since(SystemTime::now())
                            .unwrap_or(Duration::ZERO);
                        again.push((ns.clone(), Instant::now() + wait));
                    }
                }
                Err(e) => {
                    let after = error_policy(&e, self.namespaces.failed(ns));
                    if matches!(e, QueueError::Conflict(_)) {
                        self.metrics.status_write(true);
                    } else {
                        self.metrics.error();
                        tracing::warn!(namespace = %ns, error = %e, retry_in = ?after, "quota reconcile failed");
                    }
                    again.push((ns.clone(), Instant::now() + after));
                }
            }
        }
        again
    }

    async fn reconcile(
        &mut self,
        ns: &str,
        now: SystemTime,
        working: &mut Working,
    ) -> Result<Option<SystemTime>, QueueError> {
        self.metrics.cycle();
        let pods = self.watched.pods.in_namespace(ns);
        self.namespaces.forget_gone(ns, &pods);
        self.own_writes.forget_shown(ns, &pods);
        if self.watched.quotas.in_namespace(ns).is_empty()
            && !pods.iter().any(|p| pods::is_queued(p))
        {
            self.metrics.set_waiting(ns, Vec::new(), 0);
            return Ok(None);
        }
        if let Some(wait) = self.settle_later(ns, &pods) {
            // Only usage to settle, and the last write was just now: come back for it.
            return Ok(Some(now + wait));
        }
        let claims = self.watched.claims.in_namespace(ns);
        let templates = self.watched.template_specs(ns);
        let catalog = self.watched.catalog().clone();
        let queued = pods.iter().any(|p| pods::is_queued(p));
        let kueue = self.opts.settings.kueue;
        let candidates = self
            .evictions
            .candidates(ns, (queued, kueue), &self.watched);
        let book = self.meter.as_ref().and_then(Meter::book);
        let inputs = Inputs {
            namespace: ns,
            pods: &pods,
            claims: &claims,
            templates: &templates,
            catalog: &catalog,
            now,
            settings: self.opts.settings,
            hours: book.as_deref(),
            candidates: &candidates,
        };
        let decision = self.decide_and_write(&inputs, working).await?;
        self.metrics
            .set_waiting(ns, quota_names(&decision), decision.waiting.len() as u64);
        let released = self.release(ns, &decision, &pods).await;
        // A refused eviction is chosen around at once.
        let (client, instance, cached) = (&self.client, &self.opts.instance, &self.watched.pods);
        let evicted = self
            .evictions
            .evict(client, instance, &self.metrics, cached, &decision);
        let again = evicted.await.then(|| now + Duration::from_secs(1));
        self.notes(ns, &decision.waiting).await;
        self.admitted_notes(ns, released).await;
        self.quota_events(ns, &decision).await;
        let unblock = (!candidates.is_empty()).then(|| self.evictions.next_unblock());
        Ok([decision.next_deadline, again, unblock.flatten()]
            .into_iter()
            .flatten()
            .min())
    }

    /// Decides the namespace on a fresh list of its quotas and writes them; a conflicting
    /// write decides again at once, up to [`CONFLICT_RETRIES`] times.
    async fn decide_and_write(
        &mut self,
        inputs: &Inputs<'_>,
        working: &mut Working,
    ) -> Result<Decision, QueueError> {
        let ns = inputs.namespace;
        let math = |source| QueueError::Math {
            namespace: ns.into(),
            cause: source,
        };
        let observed = namespace::observe(inputs, self.namespaces.charges()).map_err(math)?;
        let api: Api<GpuQuota> = Api::namespaced(self.client.clone(), ns);
        let mut conflicts = 0;
        loop {
            let fresh = api
                .list(&ListParams::default())
                .await
                .map_err(|e| api_error("listing GpuQuotas in", ns, e))?
                .items;
            let decision = namespace::decide(inputs, &observed, &fresh, working).map_err(math)?;
            let written = self
                .own_writes
                .write_quotas(ns, &api, &decision, &self.metrics);
            match written.await {
                // Decide again at once from a fresh read: after a backoff the webhook's group
                // commit, which writes the same status once per batch, would win again, and
                // the reservations this write drops would pile up in every status it writes.
                Err(QueueError::Conflict(_)) if conflicts < CONFLICT_RETRIES => {
                    conflicts += 1;
                    self.metrics.status_write(true);
                    // What this attempt charged to the cohort was never written.
                    *working = self.own_writes.working(&self.watched.quotas);
                }
                r => return r.map(|()| decision),
            }
        }
    }

    /// How long to hold back a reconcile of `ns`: `Some` when all it could write is settled
    /// usage (its quotas are all in Reject mode, so nothing is queued to release) and it was
    /// written less than `settle_interval` ago.
    fn settle_later(&self, ns: &str, pods: &[Arc<Pod>]) -> Option<Duration> {
        let wait = self.own_writes.settle_wait(ns, self.opts.settle_interval)?;
        let quotas = self.watched.quotas.in_namespace(ns);
        let reject_only = !quotas.is_empty()
            && quotas.iter().all(|q| q.spec.mode == QuotaMode::Reject)
            && !pods.iter().any(|p| pods::is_queued(p));
        reject_only.then_some(wait)
    }
}

/// The names of the namespace's GpuQuotas in a decision.
fn quota_names(d: &Decision) -> Vec<String> {
    d.quotas
        .iter()
        .filter_map(|(q, _)| q.metadata.name.clone())
        .collect()
}

/// Runs the loop with real watchers until `stop` resolves.
pub async fn run(
    client: kube::Client,
    opts: QueueOptions,
    devices: Arc<Devices>,
    metrics: Arc<QueueMetrics>,
    stop: impl Future<Output = ()>,
) {
    // The first catalog must hold what is published: pods priced without it would be charged
    // nothing for their claims.
    tokio::pin!(stop);
    tokio::select! {
        r = devices.ready() => if let Err(what) = r {
            tracing::error!(resource = what, "the watch of published devices ended; the quota loop does not start");
            return;
        },
        _ = &mut stop => return,
    }
    let (tx, rx) = mpsc::channel(1024);
    let watchers = spawn_watchers(&client, &devices, tx);
    let mut l = QueueLoop::new(client, opts, devices, metrics);
    l.drive(rx, stop).await;
    // A last flush of the GPU-hours book, so a handover or a rollout loses no interval (bounded:
    // the API server may be what went away; never from caches that have not listed).
    if l.watched.ready() {
        let _ = tokio::time::timeout(Duration::from_secs(5), l.flush_hours()).await;
    }
    for w in watchers {
        w.abort();
    }
}

impl Keyed for QueueLoop {
    type Input = Input;

    fn ready(&self) -> bool {
        self.watched.ready()
    }

    fn apply(&mut self, input: Input) -> BTreeSet<String> {
        QueueLoop::apply(self, input)
    }

    fn known(&self) -> BTreeSet<String> {
        self.watched.namespaces()
    }

    async fn run(&mut self, due: Vec<String>) -> Vec<(String, Instant)> {
        self.cycle(&due).await
    }

    fn next_tick(&self) -> Option<Instant> {
        self.meter.as_ref().map(Meter::next)
    }

    async fn tick(&mut self) -> BTreeSet<String> {
        self.flush_hours().await
    }
}
