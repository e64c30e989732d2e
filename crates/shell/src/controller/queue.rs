//! The quota loop (I/O shell): watches pods, GpuQuotas, ResourceClaims, templates,
//! ResourceSlices and DeviceClasses into [`Cache`]s, and reconciles each namespace that
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

use super::cache::Cache;
use super::ledger::{compact, Working};
use super::metrics::QueueMetrics;
use super::namespace::{self, Decision, Inputs, Note, QueueSettings};
use super::pods::{self, PodRef};
use super::writes::{self, Ungated};
use crate::quota::{
    governs_pod, CatalogSettings, DeviceCatalog, GpuQuota, QuotaMathError, QuotaMode,
};
use gpuplane_model::report::chain;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::schedule::{drive, Keyed, Timing};
use tokio_stream::StreamExt;

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
        }
    }
}

/// Why a namespace's reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// An API call failed.
    #[error("{op} {object}: {}", chain(.cause))]
    Api {
        op: &'static str,
        object: String,
        cause: Box<kube::Error>,
    },
    /// A GpuQuota changed between our read and our write; the namespace is planned again.
    #[error("GpuQuota {0} changed while being written")]
    Conflict(String),
    /// Quota arithmetic overflowed.
    #[error("namespace {namespace}: {}", chain(.cause))]
    Math {
        namespace: String,
        cause: QuotaMathError,
    },
}

/// When to reconcile a namespace again after its `failures`-th consecutive failure.
pub fn error_policy(error: &QueueError, failures: u32) -> Duration {
    let exp = |base_ms: u64, cap: Duration| {
        let ms = base_ms.saturating_mul(1u64 << failures.min(16));
        Duration::from_millis(ms).min(cap)
    };
    match error {
        QueueError::Conflict(_) => exp(10, Duration::from_secs(2)),
        QueueError::Api { .. } => exp(200, Duration::from_secs(30)),
        QueueError::Math { .. } => Duration::from_secs(60),
    }
}

/// One change seen by a watcher (boxed: pods are large).
#[derive(Debug)]
pub enum Input {
    Pod(Box<Event<Pod>>),
    Quota(Box<Event<GpuQuota>>),
    Claim(Box<Event<ResourceClaim>>),
    Template(Box<Event<ResourceClaimTemplate>>),
    Slice(Box<Event<ResourceSlice>>),
    Class(Box<Event<DeviceClass>>),
}

/// What was last said to a waiting pod.
#[derive(Debug, Clone)]
struct Memo {
    namespace: String,
    kind: &'static str,
    message: String,
    at: Instant,
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
    slices: Cache<ResourceSlice>,
    classes: Cache<DeviceClass>,
    catalog: Arc<DeviceCatalog>,
    catalog_stale: bool,
    /// Our own last writes of GpuQuotas, newer than the cache until its watch catches up.
    written: HashMap<String, GpuQuota>,
    /// Pods we ungated, by uid, until the cache shows it.
    ungated: HashMap<String, Instant>,
    memos: HashMap<String, Memo>,
    failures: HashMap<String, u32>,
    charges: namespace::Charges,
    /// When each namespace's quotas were last written.
    settled: HashMap<String, Instant>,
}

impl QueueLoop {
    pub fn new(client: kube::Client, opts: QueueOptions, metrics: Arc<QueueMetrics>) -> QueueLoop {
        QueueLoop {
            client,
            opts,
            metrics,
            pods: Cache::default(),
            quotas: Cache::default(),
            claims: Cache::default(),
            templates: Cache::default(),
            slices: Cache::default(),
            classes: Cache::default(),
            catalog: Arc::new(DeviceCatalog::default()),
            catalog_stale: true,
            written: HashMap::new(),
            ungated: HashMap::new(),
            memos: HashMap::new(),
            failures: HashMap::new(),
            charges: namespace::Charges::default(),
            settled: HashMap::new(),
        }
    }

    fn ready(&self) -> bool {
        self.pods.is_ready()
            && self.quotas.is_ready()
            && self.claims.is_ready()
            && self.templates.is_ready()
            && self.slices.is_ready()
            && self.classes.is_ready()
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
            Input::Pod(e) => self.pods.apply(*e),
            Input::Claim(e) => self.claims.apply(*e),
            Input::Template(e) => {
                // A pod's charge may come from its templates.
                self.charges.clear();
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
            Input::Slice(e) => {
                self.slices.apply(*e);
                self.catalog_stale = true;
                self.known_namespaces()
            }
            Input::Class(e) => {
                self.classes.apply(*e);
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

    /// Reconciles `namespaces`; returns when each wants to run again.
    pub async fn cycle(&mut self, namespaces: &[String]) -> Vec<(String, Instant)> {
        if self.catalog_stale {
            let slices: Vec<ResourceSlice> = self.slices.all().map(|s| (**s).clone()).collect();
            let classes: Vec<DeviceClass> = self.classes.all().map(|c| (**c).clone()).collect();
            self.catalog = Arc::new(DeviceCatalog::new(
                &slices,
                &classes,
                self.opts.catalog.clone(),
            ));
            self.catalog_stale = false;
            self.charges.clear();
        }
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
                .filter(|w| version(w) > version(q))
                .cloned();
            if newer.is_none() {
                self.written.remove(&id);
            }
            let q = newer.unwrap_or_else(|| (**q).clone());
            match compact(&q, &BTreeSet::new()) {
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
        self.ungated.retain(|uid, at| {
            gated.contains(uid.as_str()) && at.elapsed() < Duration::from_secs(60)
        });
        if self.quotas.in_namespace(ns).is_empty() && !pods.iter().any(|p| pods::is_queued(p)) {
            self.metrics.set_waiting(ns, Vec::new(), 0);
            return Ok(None);
        }
        if let Some(wait) = self.settle_later(ns, &pods) {
            // Only usage to settle, and the last write was just now: come back for it.
            return Ok(Some(now + wait));
        }
        let api: Api<GpuQuota> = Api::namespaced(self.client.clone(), ns);
        let claims = self.claims.in_namespace(ns);
        let templates: BTreeMap<String, ResourceClaimSpec> = self
            .templates
            .in_namespace(ns)
            .iter()
            .map(|t| {
                (
                    t.metadata.name.clone().unwrap_or_default(),
                    t.spec.spec.clone(),
                )
            })
            .collect();
        let catalog = self.catalog.clone();
        let inputs = Inputs {
            namespace: ns,
            pods: &pods,
            claims: &claims,
            templates: &templates,
            catalog: &catalog,
            now,
            settings: self.opts.settings,
        };
        let math = |source| QueueError::Math {
            namespace: ns.into(),
            cause: source,
        };
        let observed = namespace::observe(&inputs, &mut self.charges).map_err(math)?;
        let mut conflicts = 0;
        let decision = loop {
            let fresh = api
                .list(&ListParams::default())
                .await
                .map_err(|e| api_error("listing GpuQuotas in", ns, e))?
                .items;
            let decision = namespace::decide(&inputs, &observed, &fresh, working).map_err(math)?;
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
                r => break r.map(|()| decision)?,
            }
        };
        self.metrics
            .set_waiting(ns, quota_names(&decision), decision.waiting.len() as u64);
        let released = self.release(ns, &decision, &pods).await;
        self.notes(ns, &decision.waiting).await;
        self.admitted_notes(ns, released).await;
        Ok(decision.next_deadline)
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

    /// Removes the gates of the released units and of pods admitted earlier; returns the pods
    /// released that had been told to wait (they are told they are admitted).
    async fn release(&mut self, ns: &str, d: &Decision, all: &[Arc<Pod>]) -> Vec<PodRef> {
        let mut todo: Vec<PodRef> = d.releases.iter().flatten().cloned().collect();
        todo.extend(
            d.admitted_gated
                .iter()
                .filter(|p| !self.ungated.contains_key(&p.uid))
                .cloned(),
        );
        if todo.is_empty() {
            return Vec::new();
        }
        let created: HashMap<&str, SystemTime> = all
            .iter()
            .filter_map(|p| Some((p.metadata.uid.as_deref()?, pods::created(p))))
            .collect();
        let quotas = quota_names(d);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let mut told = Vec::new();
        let results = bounded(self.opts.concurrency, todo, |p| {
            let api = api.clone();
            async move {
                let r = writes::ungate(&api, &p).await;
                (p, r)
            }
        })
        .await;
        for (p, r) in results {
            match r {
                Ok(Ungated::Removed) | Ok(Ungated::AlreadyGone) => {
                    let waited = created
                        .get(p.uid.as_str())
                        .and_then(|c| SystemTime::now().duration_since(*c).ok())
                        .unwrap_or_default();
                    if matches!(r, Ok(Ungated::Removed)) {
                        self.metrics.released(ns, &quotas, waited);
                    }
                    self.ungated.insert(p.uid.clone(), Instant::now());
                    if p.condition.is_some() || self.memos.contains_key(&p.uid) {
                        told.push(p);
                    }
                }
                Ok(Ungated::PodGone) => {}
                Err(e) => {
                    self.metrics.error();
                    tracing::warn!(pod = %format!("{ns}/{}", p.name), error = %e, "removing the admission gate failed; retried next cycle");
                }
            }
        }
        told
    }

    /// Tells waiting pods why (condition always current in kind, numbers refreshed at most
    /// every `note_refresh`; an Event when the kind of reason changes).
    async fn notes(&mut self, ns: &str, waiting: &[(PodRef, Note)]) {
        let now = Instant::now();
        let mut todo = Vec::new();
        for (p, note) in waiting {
            let memo = self.memos.get(&p.uid);
            let shown = p
                .condition
                .as_ref()
                .filter(|(_, s, _)| s == "False")
                .map(|(_, _, m)| m.as_str());
            let said = memo.map(|m| m.message.as_str());
            let current =
                shown == Some(note.message.as_str()) || said == Some(note.message.as_str());
            let kind_changed = memo.is_none_or(|m| m.kind != note.kind);
            let refresh_due =
                memo.is_none_or(|m| now.duration_since(m.at) >= self.opts.note_refresh);
            let condition = shown.is_none() || (!current && (kind_changed || refresh_due));
            let event = match memo {
                Some(m) => m.kind != note.kind,
                // After a restart: only pods never told before.
                None => shown.is_none(),
            };
            if condition || event {
                todo.push((p.clone(), note.clone(), condition, event));
            }
            if todo.len() >= self.opts.notes_per_cycle {
                break;
            }
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let events: Api<CoreEvent> = Api::namespaced(self.client.clone(), ns);
        let instance = self.opts.instance.clone();
        let results = bounded(
            self.opts.concurrency,
            todo,
            |(p, note, condition, event)| {
                let (pods, events, instance) = (pods.clone(), events.clone(), instance.clone());
                async move {
                    let mut r = Ok(());
                    if condition {
                        r = writes::set_condition(&pods, &p, false, "Waiting", &note.message).await;
                    }
                    if event && r.is_ok() {
                        let warning = matches!(note.kind, "ExceedsQuota" | "Unpriced" | "BadGroup");
                        r = writes::event(
                            &events,
                            &p,
                            warning,
                            &format!("Quota{}", note.kind),
                            &note.message,
                            &instance,
                        )
                        .await;
                    }
                    (p, note, r)
                }
            },
        )
        .await;
        for (p, note, r) in results {
            match r {
                Ok(()) => {
                    self.memos.insert(
                        p.uid.clone(),
                        Memo {
                            namespace: ns.into(),
                            kind: note.kind,
                            message: note.message,
                            at: now,
                        },
                    );
                }
                Err(e) => {
                    tracing::warn!(pod = %format!("{ns}/{}", p.name), error = %e, "recording why a pod waits failed")
                }
            }
        }
    }

    async fn admitted_notes(&mut self, ns: &str, told: Vec<PodRef>) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let events: Api<CoreEvent> = Api::namespaced(self.client.clone(), ns);
        let instance = self.opts.instance.clone();
        let message =
            format!("admitted by the GpuQuotas of namespace {ns}; the scheduling gate is removed");
        for p in &told {
            self.memos.remove(&p.uid);
        }
        let results = bounded(self.opts.concurrency, told, |p| {
            let (pods, events, instance, message) = (
                pods.clone(),
                events.clone(),
                instance.clone(),
                message.clone(),
            );
            async move {
                let mut r = writes::set_condition(&pods, &p, true, "Admitted", &message).await;
                if r.is_ok() {
                    r = writes::event(&events, &p, false, "QuotaAdmitted", &message, &instance)
                        .await;
                }
                (p, r)
            }
        })
        .await;
        for (p, r) in results {
            if let Err(e) = r {
                tracing::warn!(pod = %format!("{ns}/{}", p.name), error = %e, "recording a pod's admission failed");
            }
        }
    }
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

fn api_error(op: &'static str, object: &str, e: kube::Error) -> QueueError {
    QueueError::Api {
        op,
        object: object.into(),
        cause: Box::new(e),
    }
}

/// Runs `f` over `items` with at most `limit` in flight; results in completion order.
async fn bounded<T, R, F, Fut>(limit: usize, items: Vec<T>, f: F) -> Vec<R>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let mut set = JoinSet::new();
    let mut out = Vec::with_capacity(items.len());
    let mut items = items.into_iter();
    loop {
        while set.len() < limit.max(1) {
            match items.next() {
                Some(t) => {
                    set.spawn(f(t));
                }
                None => break,
            }
        }
        match set.join_next().await {
            Some(Ok(r)) => out.push(r),
            Some(Err(e)) => tracing::warn!(error = %e, "a write task failed"),
            None => break,
        }
    }
    out
}

/// Watches `api` with `config` in a task, feeding `tx` until the receiver goes away; `wrap`
/// turns an event into the loop's input, or `None` for one the loop does not need. Shared with
/// [`super::labeler`].
pub(super) fn forward<K, T, F>(
    api: Api<K>,
    config: watcher::Config,
    tx: mpsc::Sender<T>,
    wrap: F,
) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
    T: Send + 'static,
    F: Fn(Event<K>) -> Option<T> + Send + 'static,
{
    tokio::spawn(async move {
        let stream = watcher::watcher(api, config).default_backoff();
        tokio::pin!(stream);
        while let Some(item) = stream.next().await {
            match item {
                Ok(ev) => {
                    let Some(input) = wrap(ev) else { continue };
                    if tx.send(input).await.is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "watch failed; retrying with backoff"),
            }
        }
    })
}

/// Watches every resource the loop reads, feeding `tx` until the receiver goes away.
pub fn spawn_watchers(
    client: &kube::Client,
    tx: mpsc::Sender<Input>,
) -> Vec<tokio::task::JoinHandle<()>> {
    vec![
        // Only pods the quota governs are cached: a cluster's many pods without GPUs cost the
        // controller nothing but their decoding (the rule is immutable per pod, so a dropped
        // pod never needs a delete).
        forward(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default(),
            tx.clone(),
            |e| {
                let governed = match &e {
                    Event::Apply(p) | Event::InitApply(p) | Event::Delete(p) => governs_pod(p),
                    Event::Init | Event::InitDone => true,
                };
                governed.then(|| Input::Pod(Box::new(e.modify(slim_pod))))
            },
        ),
        forward(
            Api::<GpuQuota>::all(client.clone()),
            watcher::Config::default(),
            tx.clone(),
            |e| Some(Input::Quota(Box::new(e))),
        ),
        forward(
            Api::<ResourceClaim>::all(client.clone()),
            watcher::Config::default(),
            tx.clone(),
            |e| Some(Input::Claim(Box::new(e))),
        ),
        forward(
            Api::<ResourceClaimTemplate>::all(client.clone()),
            watcher::Config::default(),
            tx.clone(),
            |e| Some(Input::Template(Box::new(e))),
        ),
        forward(
            Api::<ResourceSlice>::all(client.clone()),
            watcher::Config::default(),
            tx.clone(),
            |e| Some(Input::Slice(Box::new(e))),
        ),
        forward(
            Api::<DeviceClass>::all(client.clone()),
            watcher::Config::default(),
            tx,
            |e| Some(Input::Class(Box::new(e))),
        ),
    ]
}

/// Drops what the loop never reads of a governed pod: managed fields, annotations other than
/// ours, container env, commands, probes and volumes (pods are large; the cache keeps many).
fn slim_pod(p: &mut Pod) {
    p.metadata.managed_fields = None;
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.retain(|k, _| k.starts_with("quota.gpuplane.dev/"));
    }
    if let Some(spec) = p.spec.as_mut() {
        spec.volumes = None;
        for c in spec
            .containers
            .iter_mut()
            .chain(spec.init_containers.iter_mut().flatten())
        {
            c.env = None;
            c.env_from = None;
            c.command = None;
            c.args = None;
            c.liveness_probe = None;
            c.readiness_probe = None;
            c.startup_probe = None;
            c.volume_mounts = None;
        }
    }
}

/// Runs the loop with real watchers until `stop` resolves.
pub async fn run(
    client: kube::Client,
    opts: QueueOptions,
    metrics: Arc<QueueMetrics>,
    stop: impl Future<Output = ()>,
) {
    let (tx, rx) = mpsc::channel(1024);
    let watchers = spawn_watchers(&client, tx);
    let mut l = QueueLoop::new(client, opts, metrics);
    l.drive(rx, stop).await;
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
}
