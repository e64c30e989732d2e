//! The GPU-hours ledger's shell (leader only, inside the quota loop): keeps each governed
//! pod's metering view ([`Metered`]: run interval, charge, owner labels) and the pods seen
//! deleted, and every [`HoursOptions::interval`] accounts them into the book
//! ([`hours::account`]) and writes it: one ConfigMap ([`BOOK_NAME`] in the controller's
//! namespace, key [`BOOK_KEY`]), replaced with the resourceVersion it was read at, so the
//! totals and the watermark move together and a second writer (an old leader) conflicts,
//! re-reads and accounts again from the new watermark. Successful flushes feed the counters
//! (`gpuplane_gpu_seconds_total`, ...) and the book the queue loop stamps into each GpuQuota's
//! `status.gpuHours`.
//!
//! With a Prometheus ([`HoursOptions::prometheus`]) each flush then books the busy GPU-seconds
//! and peak GPU memory of the window past the book's busy watermark from the samples
//! Prometheus kept of the agents' series ([`hours::account_busy`]), written the same way. Busy
//! time has its own watermark: while Prometheus cannot be reached it stays behind, and the
//! allocated time goes on; once back, it catches up an hour per flush.

use super::hours::{self, Accounted, Book, HoursSettings, Metered};
use super::prometheus::{Prometheus, PrometheusError};
use crate::controller_metrics::QueueMetrics;
use crate::quota::{pod_charge, DeviceCatalog, GpuQuota};
use gpuplane_model::report::chain;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::resource::v1::ResourceClaimSpec;
use kube::api::{Api, ObjectMeta, PostParams};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

/// The ConfigMap holding the book, in the controller's namespace.
pub const BOOK_NAME: &str = "gpuplane-gpu-hours";
/// Its data key: the book as JSON.
pub const BOOK_KEY: &str = "book.json";
/// A flush that conflicts is accounted again from a fresh read this many times.
const CONFLICT_RETRIES: u32 = 5;

/// How the ledger runs.
#[derive(Debug, Clone)]
pub struct HoursOptions {
    pub settings: HoursSettings,
    /// How often the book is written.
    pub interval: Duration,
    /// Where the book's ConfigMap lives (the controller's namespace).
    pub namespace: String,
    /// Where busy time and peak memory are read from; `None`: not measured.
    pub prometheus: Option<Prometheus>,
}

impl Default for HoursOptions {
    fn default() -> Self {
        HoursOptions {
            settings: HoursSettings::default(),
            interval: Duration::from_secs(30),
            namespace: "gpuplane-system".into(),
            prometheus: None,
        }
    }
}

/// Why a flush failed (it is tried again at the next interval).
#[derive(Debug, thiserror::Error)]
pub enum HoursError {
    #[error("{op} ConfigMap {object}: {}", chain(.cause))]
    Api {
        op: &'static str,
        object: String,
        cause: Box<kube::Error>,
    },
    #[error("ConfigMap {object}: {cause}")]
    Book {
        object: String,
        cause: hours::BookError,
    },
    #[error("no GPU-hours book: ConfigMap {0} not found; is `gpuplane controller` running (its leader writes it every 30 s), and is --controller-namespace its namespace?")]
    Missing(String),
    #[error("ConfigMap {0} kept changing under the flush; trying again at the next interval")]
    Conflicts(String),
    #[error("busy GPU time not booked: {0}")]
    Prometheus(#[from] PrometheusError),
}

/// The agents' series busy time and peak memory are read from.
const BUSY_SERIES: &str = "gpuplane_container_gpu_busy_seconds_total";
const MEMORY_SERIES: &str = "gpuplane_container_gpu_memory_used_bytes";

/// What the pods' views are priced with.
pub struct Pricing<'a> {
    pub catalog: &'a DeviceCatalog,
    /// The ResourceClaimTemplates of a namespace, by name.
    pub templates: &'a (dyn Fn(&str) -> BTreeMap<String, ResourceClaimSpec> + Sync),
}

/// The ledger's state between flushes.
pub struct Meter {
    opts: HoursOptions,
    /// Each pod's view by uid, with the resourceVersion it was read at (`None`: not metered).
    seen: HashMap<String, (String, Option<Metered>)>,
    /// Pods gone from the cache, until the watermark passes their end.
    gone: HashMap<String, Metered>,
    /// The book as last read or written, with its resourceVersion.
    book: Option<(Arc<Book>, String)>,
    next: Instant,
}

fn millis(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

impl Meter {
    pub fn new(opts: HoursOptions) -> Meter {
        Meter {
            opts,
            seen: HashMap::new(),
            gone: HashMap::new(),
            book: None,
            next: Instant::now(),
        }
    }

    /// When the next flush is due.
    pub fn next(&self) -> Instant {
        self.next
    }

    /// The book as last read or written (the quota loop shows its totals in status).
    pub fn book(&self) -> Option<Arc<Book>> {
        self.book.as_ref().map(|(b, _)| b.clone())
    }

    /// Charges depend on templates and the catalog: price every pod again.
    pub fn reprice(&mut self) {
        self.seen.clear();
    }

    /// A pod was deleted: its last status says when it ended (else now); its time is counted
    /// until the watermark passes that.
    pub fn deleted(&mut self, pod: &Pod, pricing: &Pricing<'_>) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let mut view = self.view(pod, pricing);
        if let Some(v) = view.as_mut() {
            v.interval.end = v.interval.end.or(Some(millis(SystemTime::now())));
            self.gone.insert(uid.clone(), v.clone());
        }
        self.seen.remove(&uid);
    }

    /// The pod's view, priced again only when its resourceVersion changed.
    fn view(&mut self, pod: &Pod, pricing: &Pricing<'_>) -> Option<Metered> {
        let uid = pod.metadata.uid.as_deref()?;
        let rv = pod.metadata.resource_version.clone().unwrap_or_default();
        if let Some((at, v)) = self.seen.get(uid) {
            if *at == rv {
                return v.clone();
            }
        }
        let owners = &self.opts.settings.owner_labels;
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let v = match pod_charge(pod, &(pricing.templates)(ns), pricing.catalog) {
            Ok(c) => Metered::of(pod, &c.usage, owners),
            Err(e) => {
                let name = pod.metadata.name.as_deref().unwrap_or_default();
                tracing::warn!(pod = %format!("{ns}/{name}"), error = %e, "a GPU pod cannot be charged; its time is not counted");
                None
            }
        };
        self.seen.insert(uid.to_string(), (rv, v.clone()));
        v
    }

    /// Accounts every pod up to now less the lag and writes the book; returns the namespaces
    /// whose GpuQuotas' totals grew. Failures are logged and tried again at the next interval.
    pub async fn flush(
        &mut self,
        client: &kube::Client,
        pods: &[Arc<Pod>],
        quotas: &[Arc<GpuQuota>],
        pricing: &Pricing<'_>,
        metrics: &QueueMetrics,
    ) -> BTreeSet<String> {
        self.next = Instant::now() + self.opts.interval;
        let views = self.views(pods, pricing);
        let mut by_ns: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for q in quotas {
            let ns = q.metadata.namespace.clone().unwrap_or_default();
            by_ns
                .entry(ns)
                .or_default()
                .push(q.metadata.name.clone().unwrap_or_default());
        }
        let upto = millis(SystemTime::now()) - lag_ms(&self.opts.settings);
        let settings = self.opts.settings.clone();
        let written = self
            .write(client, |book| {
                Some(hours::account(book, &views, &by_ns, upto, &settings))
            })
            .await;
        let mut added = match written {
            Ok(added) => added.unwrap_or_default(),
            Err(e) => {
                tracing::warn!(error = %e, "GPU-hours flush failed; trying again at the next interval");
                BTreeMap::new()
            }
        };
        if let Some(prometheus) = self.opts.prometheus.clone() {
            match self
                .flush_busy(client, &prometheus, &views, &by_ns, upto)
                .await
            {
                Ok(busy) => busy
                    .into_iter()
                    .for_each(|(s, t)| *added.entry(s).or_default() += t),
                Err(e) => {
                    tracing::warn!(error = %e, "busy GPU time is behind; trying again at the next interval")
                }
            }
        }
        // A gone pod's view is kept until both watermarks pass its end (a day at most).
        let book = self.book();
        let busy_until = self.opts.prometheus.as_ref().map(|_| {
            let w = book.as_ref().and_then(|b| b.busy_watermark());
            w.unwrap_or(upto).max(upto - 86_400_000)
        });
        let counted = book.and_then(|b| b.watermark()).unwrap_or(i64::MIN);
        let until = busy_until.map_or(counted, |b| b.min(counted));
        self.gone
            .retain(|_, m| m.interval.end.is_some_and(|e| e > until));
        metrics.gpu_time(&self.opts.settings.owner_labels, &added);
        added
            .keys()
            .filter_map(|s| match s {
                hours::Series::Quota { namespace, .. } => Some(namespace.clone()),
                hours::Series::Tenant { .. } => None,
            })
            .collect()
    }

    /// Books the busy window past the book's busy watermark from Prometheus' samples; what it
    /// added (empty when there was nothing to do).
    async fn flush_busy(
        &mut self,
        client: &kube::Client,
        prometheus: &Prometheus,
        views: &[Metered],
        quotas: &BTreeMap<String, Vec<String>>,
        upto: i64,
    ) -> Result<BTreeMap<hours::Series, hours::Totals>, HoursError> {
        let (book, rv) = self.current(client).await?;
        self.book = Some((book.clone(), rv));
        let Some(window @ (from, to)) = hours::busy_window(&book, upto) else {
            return Ok(BTreeMap::new());
        };
        let busy = prometheus
            .samples(BUSY_SERIES, to - from + hours::LOOKBACK_MS, to)
            .await?;
        let memory = prometheus.samples(MEMORY_SERIES, to - from, to).await?;
        let settings = self.opts.settings.clone();
        let account = |book: &Book| -> Option<Accounted> {
            // Another writer moved the busy watermark: these samples are for a window no
            // longer next; the next flush asks again.
            (hours::busy_window(book, upto).map(|(f, _)| f) == Some(from)).then(|| {
                hours::account_busy(book, &busy, &memory, views, quotas, window, &settings)
            })
        };
        Ok(self.write(client, account).await?.unwrap_or_default())
    }

    /// Every cached pod's view and the gone ones'; a pod the cache lost without a delete (a
    /// re-list) is gone as of now.
    fn views(&mut self, pods: &[Arc<Pod>], pricing: &Pricing<'_>) -> Vec<Metered> {
        let mut out = Vec::with_capacity(pods.len() + self.gone.len());
        let mut present = BTreeSet::new();
        for p in pods {
            if let Some(uid) = p.metadata.uid.as_deref() {
                present.insert(uid.to_string());
            }
            out.extend(self.view(p, pricing));
        }
        let now = millis(SystemTime::now());
        let lost: Vec<String> = self
            .seen
            .keys()
            .filter(|u| !present.contains(*u))
            .cloned()
            .collect();
        for uid in lost {
            if let Some((_, Some(mut v))) = self.seen.remove(&uid) {
                v.interval.end = v.interval.end.or(Some(now));
                self.gone.insert(uid, v);
            }
        }
        out.extend(self.gone.values().cloned());
        out
    }

    /// The book as last read or written, else read now, with its resourceVersion.
    async fn current(&self, client: &kube::Client) -> Result<(Arc<Book>, String), HoursError> {
        match self.book.clone() {
            Some(b) => Ok(b),
            None => {
                let api: Api<ConfigMap> = Api::namespaced(client.clone(), &self.opts.namespace);
                read(&api, &self.object()).await
            }
        }
    }

    fn object(&self) -> String {
        format!("{}/{BOOK_NAME}", self.opts.namespace)
    }

    /// Accounts (`account`: `None` when there is nothing to do on that book) and writes with
    /// the resourceVersion read; a conflict reads and accounts again. `Some(added)` once
    /// written, `None` when there was nothing to add.
    async fn write(
        &mut self,
        client: &kube::Client,
        account: impl Fn(&Book) -> Option<Accounted>,
    ) -> Result<Option<BTreeMap<hours::Series, hours::Totals>>, HoursError> {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), &self.opts.namespace);
        let object = self.object();
        for _ in 0..CONFLICT_RETRIES {
            let (book, rv) = self.current(client).await?;
            let Some(out) = account(&book).filter(|out| out.book != *book) else {
                self.book = Some((book, rv));
                return Ok(None);
            };
            let mut data = BTreeMap::new();
            data.insert(BOOK_KEY.to_string(), out.book.to_json());
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(BOOK_NAME.into()),
                    resource_version: (!rv.is_empty()).then(|| rv.clone()),
                    ..ObjectMeta::default()
                },
                data: Some(data),
                ..ConfigMap::default()
            };
            let pp = PostParams::default();
            let written = if rv.is_empty() {
                api.create(&pp, &cm).await
            } else {
                api.replace(BOOK_NAME, &pp, &cm).await
            };
            match written {
                Ok(w) => {
                    let rv = w.metadata.resource_version.unwrap_or_default();
                    self.book = Some((Arc::new(out.book), rv));
                    return Ok(Some(out.added));
                }
                Err(kube::Error::Api(s)) if s.code == 409 => self.book = None,
                Err(e) => {
                    self.book = None;
                    return Err(api_error("writing", &object, e));
                }
            }
        }
        Err(HoursError::Conflicts(object))
    }
}

fn lag_ms(s: &HoursSettings) -> i64 {
    i64::try_from(s.lag.as_millis()).unwrap_or(i64::MAX)
}

/// The stored book and its resourceVersion (`""` and a new book when there is none).
pub async fn read(api: &Api<ConfigMap>, object: &str) -> Result<(Arc<Book>, String), HoursError> {
    let cm = api
        .get_opt(BOOK_NAME)
        .await
        .map_err(|e| api_error("reading", object, e))?;
    let Some(cm) = cm else {
        return Ok((Arc::new(Book::default()), String::new()));
    };
    let text = cm.data.as_ref().and_then(|d| d.get(BOOK_KEY));
    let book = match text {
        Some(t) => Book::from_json(t).map_err(|cause| HoursError::Book {
            object: object.into(),
            cause,
        })?,
        None => Book::default(),
    };
    Ok((
        Arc::new(book),
        cm.metadata.resource_version.unwrap_or_default(),
    ))
}

fn api_error(op: &'static str, object: &str, e: kube::Error) -> HoursError {
    HoursError::Api {
        op,
        object: object.into(),
        cause: Box::new(e),
    }
}

/// What `gpuplane report` asks for.
#[derive(Debug, Clone)]
pub struct ReportQuery {
    /// The controller's namespace, where the book is kept.
    pub controller_namespace: String,
    pub by: hours::By,
    pub namespace: Option<String>,
    /// First day (`YYYY-MM-DD` or an RFC 3339 time); none: the book's current month.
    pub since: Option<String>,
    /// First day not counted; none: up to the watermark.
    pub until: Option<String>,
}

/// Reads the book and sums it per tenant over the query's window.
pub async fn report(client: &kube::Client, q: &ReportQuery) -> Result<hours::Report, HoursError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &q.controller_namespace);
    let object = format!("{}/{BOOK_NAME}", q.controller_namespace);
    let (book, rv) = read(&api, &object).await?;
    if rv.is_empty() {
        return Err(HoursError::Missing(object));
    }
    let day = |t: &Option<String>| {
        t.as_deref()
            .map(hours::parse_day)
            .transpose()
            .map_err(|cause| HoursError::Book {
                object: object.clone(),
                cause,
            })
    };
    let since = match day(&q.since)? {
        Some(d) => Some(d),
        None => book
            .watermark()
            .map(|w| format!("{}-01", hours::period_of(w))),
    };
    let until = day(&q.until)?;
    Ok(book.report(
        &q.by,
        q.namespace.as_deref(),
        since.as_deref(),
        until.as_deref(),
    ))
}
