//! The quota loop (I/O shell): watches pods, GpuQuotas, ResourceClaims and templates into
//! [`Cache`]s, reads the published devices from the shared [`Devices`], and reconciles each namespace that
//! changed (or whose time came) with [`namespace::decide`], then applies the decision:
//! GpuQuota status first (PUT `/status` with the resourceVersion just read; a 409 lists and
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
mod pod_writes;
mod preempt;
mod quota_events;

pub use super::watchers::{spawn_watchers, Input};
pub use error::{error_policy, QueueError};
pub use preempt::PREEMPTED_CONDITION;

use super::cache::Cache;
use super::meter::{HoursOptions, Meter, Pricing};
use super::metrics::QueueMetrics;
use super::namespace::{self, Decision, Inputs, QueueSettings};
use super::pods;
use super::quota_ledger::{compact, Working};
use super::schedule::{drive, Keyed, Timing};
use crate::published::Devices;
use crate::quota::{CatalogSettings, DeviceCatalog, GpuQuota, QuotaMode};
use error::api_error;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::watcher::Event;
use pod_writes::Memo;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;
use tokio::time::Instant;

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

/// The loop's state.
pub struct QueueLoop {
    client: kube::Client,
    opts: QueueOptions,
    metrics: Arc<QueueMetrics>,
    pods: Cache<Pod>,
    quotas: Cache<GpuQuota>,
    claims: Cache<ResourceClaim>,
    templates: Cache<ResourceClaimTemplate>,
    devices: Arc<Devices>,
    catalog: Arc<DeviceCatalog>,
    catalog_stale: bool,
    /// Our own last writes of GpuQuotas, newer than the cache until its watch catches up.
    written: HashMap<String, GpuQuota>,
    /// Pods we ungated, by uid, with their namespace and when, until the cache shows it.
    ungated: HashMap<String, (String, Instant)>,
    memos: HashMap<String, Memo>,
    failures: HashMap<String, u32>,
    charges: namespace::Charges,
    /// When each namespace's quotas were last written.
    settled: HashMap<String, Instant>,
    meter: Option<Meter>,
    evictions: preempt::Evictions,
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
            pods: Cache::default(),
            quotas: Cache::default(),
            claims: Cache::default(),
            templates: Cache::default(),
            devices,
            catalog: Arc::new(DeviceCatalog::default()),
            catalog_stale: true,
            written: HashMap::new(),
            ungated: HashMap::new(),
            memos: HashMap::new(),
            failures: HashMap::new(),
            charges: namespace::Charges::default(),
            settled: HashMap::new(),
            meter,
            evictions: preempt::Evictions::default(),
        }
    }

    fn ready(&self) -> bool {
        self.pods.is_ready()
            && self.quotas.is_ready()
            && self.claims.is_ready()
            && self.templates.is_ready()
    }

    fn known_namespaces(&self) -> BTreeSet<String> {
        self.quotas
            .namespaces()
            .chain(self.pods.namespaces())
            .cloned()
            .collect()
    }

    /// Applies one input; returns the namespaces to reconcile because of it.
    fn apply(&mut self, input: Input) -> BTreeSet<String> {
        match input {
            Input::Pod(e) => {
                if let (Some(m), Event::Delete(p)) = (self.meter.as_mut(), &*e) {
                    let templates = |ns: &str| template_specs(&self.templates, ns);
                    m.deleted(
                        p,
                        &Pricing {
                            catalog: &self.catalog,
                            templates: &templates,
                        },
                    );
                }
                self.pods.apply(*e)
            }
            Input::Claim(e) => self.claims.apply(*e),
            Input::Template(e) => {
                // A pod's charge may come from its templates.
                self.reprice();
                self.templates.apply(*e)
            }
            Input::Quota(e) => {
                let e = *e;
                let cohorts: Vec<String> = match &e {
                    Event::Apply(q) | Event::Delete(q) | Event::InitApply(q) => {
                        q.spec.cohort.iter().cloned().collect()
                    }
                    _ => Vec::new(),
                };
                let mut touched = self.quotas.apply(e);
                // Borrowing couples the namespaces of a cohort.
                for q in self.quotas.all() {
                    if q.spec.cohort.as_ref().is_some_and(|c| cohorts.contains(c)) {
                        touched.insert(q.metadata.namespace.clone().unwrap_or_default());
                    }
                }
                touched
            }
            Input::Devices => {
                self.catalog_stale = true;
                self.known_namespaces()
            }
        }
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
        self.charges.clear();
        if let Some(m) = self.meter.as_mut() {
            m.reprice();
        }
    }

    fn refresh_catalog(&mut self) {
        if self.catalog_stale {
            self.catalog = self.devices.catalog();
            self.catalog_stale = false;
            self.reprice();
        }
    }

    /// Flushes the GPU-hours book; the namespaces whose quotas' totals grew.
    async fn flush_hours(&mut self) -> BTreeSet<String> {
        self.refresh_catalog();
        let Some(mut m) = self.meter.take() else {
            return BTreeSet::new();
        };
        let pods: Vec<_> = self.pods.all().collect();
        let quotas: Vec<_> = self.quotas.all().collect();
        let templates = |ns: &str| template_specs(&self.templates, ns);
        let pricing = Pricing {
            catalog: &self.catalog,
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
        let mut working = self.working();
        let mut again = Vec::new();
        for ns in namespaces {
            match self.reconcile(ns, SystemTime::now(), &mut working).await {
                Ok(next) => {
                    self.failures.remove(ns);
                    if let Some(t) = next {
                        let wait = t
                            .duration_since(SystemTime::now())
                            .unwrap_or(Duration::ZERO);
                        again.push((ns.clone(), Instant::now() + wait));
                    }
                }
                Err(e) => {
                    let n = self.failures.entry(ns.clone()).or_insert(0);
                    *n += 1;
                    let after = error_policy(&e, *n);
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

    /// Every cached quota (or our newer write of it), compacted.
    fn working(&mut self) -> Working {
        let mut all = Vec::new();
        for q in self.quotas.all() {
            let id = q.id();
            let newer = self
                .written
                .get(&id)
                .filter(|w| version(w) > version(&q))
                .cloned();
            if newer.is_none() {
                self.written.remove(&id);
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

    async fn reconcile(
        &mut self,
        ns: &str,
        now: SystemTime,
        working: &mut Working,
    ) -> Result<Option<SystemTime>, QueueError> {
        self.metrics.cycle();
        let pods = self.pods.in_namespace(ns);
        self.forget_gone(ns, &pods);
        if self.quotas.in_namespace(ns).is_empty() && !pods.iter().any(|p| pods::is_queued(p)) {
            self.metrics.set_waiting(ns, Vec::new(), 0);
            return Ok(None);
        }
        if let Some(wait) = self.settle_later(ns, &pods) {
            // Only usage to settle, and the last write was just now: come back for it.
            return Ok(Some(now + wait));
        }
        let claims = self.claims.in_namespace(ns);
        let templates = template_specs(&self.templates, ns);
        let catalog = self.catalog.clone();
        let candidates = self.candidates(ns, pods.iter().any(|p| pods::is_queued(p)));
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
        let again = self
            .evict(&decision)
            .await
            .then(|| now + Duration::from_secs(1));
        self.notes(ns, &decision.waiting).await;
        self.admitted_notes(ns, released).await;
        self.quota_events(ns, &decision).await;
        let unblock = (!candidates.is_empty()).then(|| self.next_unblock());
        Ok([decision.next_deadline, again, unblock.flatten()]
            .into_iter()
            .flatten()
            .min())
    }

    /// Forgets what was said to pods of `ns` that are gone, and every ungate whose pod the
    /// cache no longer shows gated (or that is a minute old: the cache missed it, so the gate
    /// is removed again).
    fn forget_gone(&mut self, ns: &str, pods: &[Arc<Pod>]) {
        let uids: BTreeSet<&str> = pods
            .iter()
            .filter_map(|p| p.metadata.uid.as_deref())
            .collect();
        self.memos
            .retain(|uid, m| m.namespace != ns || uids.contains(uid.as_str()));
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
        let observed = namespace::observe(inputs, &mut self.charges).map_err(math)?;
        let api: Api<GpuQuota> = Api::namespaced(self.client.clone(), ns);
        let mut conflicts = 0;
        loop {
            let fresh = api
                .list(&ListParams::default())
                .await
                .map_err(|e| api_error("listing GpuQuotas in", ns, e))?
                .items;
            let decision = namespace::decide(inputs, &observed, &fresh, working).map_err(math)?;
            match self.write_quotas(ns, &api, &decision).await {
                // Decide again at once from a fresh read: after a backoff the webhook's group
                // commit, which writes the same status once per batch, would win again, and
                // the reservations this write drops would pile up in every status it writes.
                Err(QueueError::Conflict(_)) if conflicts < CONFLICT_RETRIES => {
                    conflicts += 1;
                    self.metrics.status_write(true);
                    // What this attempt charged to the cohort was never written.
                    *working = self.working();
                }
                r => return r.map(|()| decision),
            }
        }
    }

    /// How long to hold back a reconcile of `ns`: `Some` when all it could write is settled
    /// usage (its quotas are all in Reject mode, so nothing is queued to release) and it was
    /// written less than `settle_interval` ago.
    fn settle_later(&self, ns: &str, pods: &[Arc<Pod>]) -> Option<Duration> {
        let elapsed = self.settled.get(ns)?.elapsed();
        let wait = self.opts.settle_interval.checked_sub(elapsed)?;
        let quotas = self.quotas.in_namespace(ns);
        let reject_only = !quotas.is_empty()
            && quotas.iter().all(|q| q.spec.mode == QuotaMode::Reject)
            && !pods.iter().any(|p| pods::is_queued(p));
        reject_only.then_some(wait)
    }

    async fn write_quotas(
        &mut self,
        ns: &str,
        api: &Api<GpuQuota>,
        d: &Decision,
    ) -> Result<(), QueueError> {
        for (q, changed) in &d.quotas {
            if !changed {
                continue;
            }
            self.settled.insert(ns.to_string(), Instant::now());
            let name = q.metadata.name.clone().unwrap_or_default();
            match api.replace_status(&name, &PostParams::default(), q).await {
                Ok(w) => {
                    self.metrics.status_write(false);
                    self.written.insert(w.id(), w);
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
}

/// A namespace's ResourceClaimTemplates by name: a pod's charge may come from them.
fn template_specs(
    templates: &Cache<ResourceClaimTemplate>,
    ns: &str,
) -> BTreeMap<String, ResourceClaimSpec> {
    templates
        .in_namespace(ns)
        .iter()
        .map(|t| {
            (
                t.metadata.name.clone().unwrap_or_default(),
                t.spec.spec.clone(),
            )
        })
        .collect()
}

/// The names of the namespace's GpuQuotas in a decision.
fn quota_names(d: &Decision) -> Vec<String> {
    d.quotas
        .iter()
        .filter_map(|(q, _)| q.metadata.name.clone())
        .collect()
}

fn version(q: &GpuQuota) -> u64 {
    q.metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
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
    if l.ready() {
        let _ = tokio::time::timeout(Duration::from_secs(5), l.flush_hours()).await;
    }
    for w in watchers {
        w.abort();
    }
}

impl Keyed for QueueLoop {
    type Input = Input;

    fn ready(&self) -> bool {
        QueueLoop::ready(self)
    }

    fn apply(&mut self, input: Input) -> BTreeSet<String> {
        QueueLoop::apply(self, input)
    }

    fn known(&self) -> BTreeSet<String> {
        self.known_namespaces()
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
