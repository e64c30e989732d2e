//! The GPU-hours ledger's accounting (pure): when a pod held its GPUs ([`run_interval`]: from
//! its containers' first start to their last finish), what it costs per second ([`Rate`]: the
//! quota's charge, whole-GPU equivalents with MIG slices and shares, and GPU memory bytes),
//! and [`account`], which adds to a [`Book`] every pod's time between the book's watermark and
//! a new one, and moves the watermark there.
//!
//! No double count: a pod's time before the watermark is never added again, and the shell
//! writes the totals and the watermark in one conditional write (a conflict re-reads the book
//! and accounts again from its watermark). No gap beyond an outage: a pod still present after
//! a restart (running or finished) is counted from the watermark by its own start and finish
//! times; only a pod deleted while no controller watched loses its time after the watermark.
//! The watermark trails the clock by a lag ([`HoursSettings::lag`]) so that a pod whose start
//! reaches the controller late (the kubelet's status update) is still counted from its start.

mod book;
mod busy;

pub use book::{
    day_of, parse_day, period_of, Book, BookError, By, Key, Report, ReportRow, Totals,
    MAX_BOOK_BYTES, MAX_KEYS_PER_DAY, MAX_MONTHS, OTHER,
};
pub use busy::{account_busy, busy_window, PodSeries, LOOKBACK_MS, MAX_BUSY_WINDOW_MS};

use super::pods;
use crate::quota::Usage;
use k8s_openapi::api::core::v1::{ContainerState, ContainerStatus, Pod};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// How the ledger runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoursSettings {
    /// Pod label keys whose values are tenants too (`team`, `cost-center`), in this order.
    pub owner_labels: Vec<String>,
    /// How far the watermark trails the clock.
    pub lag: Duration,
    /// Days kept by day before the watermark's day (older ones by month).
    pub retention_days: u32,
}

/// The default lag: a kubelet reports a container's start within seconds.
pub const DEFAULT_LAG: Duration = Duration::from_secs(15);
/// The default retention by day: the previous calendar month stays whole by day.
pub const DEFAULT_RETENTION_DAYS: u32 = 62;

impl Default for HoursSettings {
    fn default() -> Self {
        HoursSettings {
            owner_labels: Vec::new(),
            lag: DEFAULT_LAG,
            retention_days: DEFAULT_RETENTION_DAYS,
        }
    }
}

/// A duration flag's value (`30s`, `2m`, `1h 30m`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?} is not a duration like 30s or 2m: {e}"))
}

/// When a pod held its GPUs, in milliseconds since the epoch: `end` is `None` while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    pub start: i64,
    pub end: Option<i64>,
}

/// What a pod costs per second of its run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rate {
    /// Whole-GPU equivalents (a 1g.10gb slice of a 7-slice GPU is 1/7).
    pub gpus: f64,
    /// Bytes of GPU memory.
    pub gpu_memory: f64,
}

impl Rate {
    pub fn of(usage: &Usage) -> Rate {
        let g = usage.gpus;
        Rate {
            gpus: g.numer() as f64 / g.denom() as f64,
            gpu_memory: usage.gpu_memory.bytes() as f64,
        }
    }
}

/// One pod as the ledger reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Metered {
    pub namespace: String,
    /// The pod's name (busy time is reported by pod).
    pub pod: String,
    pub interval: Interval,
    pub rate: Rate,
    /// The values of [`HoursSettings::owner_labels`] on the pod (`""` where it has none).
    pub owners: Vec<String>,
}

impl Metered {
    /// The pod's view, or `None` when it has not started or costs nothing.
    pub fn of(pod: &Pod, charge: &Usage, owner_labels: &[String]) -> Option<Metered> {
        let rate = Rate::of(charge);
        if rate.gpus == 0.0 && rate.gpu_memory == 0.0 {
            return None;
        }
        let labels = pod.metadata.labels.as_ref();
        Some(Metered {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            pod: pod.metadata.name.clone().unwrap_or_default(),
            interval: run_interval(pod)?,
            rate,
            owners: owner_labels
                .iter()
                .map(|k| labels.and_then(|l| l.get(k)).cloned().unwrap_or_default())
                .collect(),
        })
    }
}

fn millis(t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> i64 {
    t.0.as_millisecond()
}

/// When the pod's containers held its devices: from the earliest container start (running
/// now, finished, or the run before a restart) to the latest finish once every container has
/// finished (or, for a pod Succeeded or Failed with no finish recorded, the last change of a
/// condition). `None` before any container started.
pub fn run_interval(pod: &Pod) -> Option<Interval> {
    let status = pod.status.as_ref()?;
    let containers = status.container_statuses.as_deref().unwrap_or_default();
    let all = containers
        .iter()
        .chain(status.init_container_statuses.iter().flatten());
    let started = |s: &ContainerState| {
        let running = s.running.as_ref().and_then(|r| r.started_at.as_ref());
        let done = s.terminated.as_ref().and_then(|t| t.started_at.as_ref());
        running.or(done).map(millis)
    };
    let start = all
        .flat_map(|c: &ContainerStatus| [c.state.as_ref(), c.last_state.as_ref()])
        .flatten()
        .filter_map(started)
        .min()?;
    let finished: Option<Vec<i64>> = containers
        .iter()
        .map(|c| {
            let t = c.state.as_ref()?.terminated.as_ref()?;
            Some(t.finished_at.as_ref().map_or(start, millis))
        })
        .collect();
    let end = match finished {
        Some(ends) if !ends.is_empty() => ends.into_iter().max(),
        _ if pods::is_terminal(pod) => Some(
            status
                .conditions
                .iter()
                .flatten()
                .filter_map(|c| c.last_transition_time.as_ref().map(millis))
                .max()
                .unwrap_or(start)
                .max(start),
        ),
        _ => None,
    };
    Some(Interval { start, end })
}

/// A counter series the shell exposes: what [`account`] added to it this round.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Series {
    /// Per namespace and owner label values (in [`HoursSettings::owner_labels`] order).
    Tenant {
        namespace: String,
        owners: Vec<String>,
    },
    /// Per GpuQuota: every pod of its namespace counts against it.
    Quota { namespace: String, quota: String },
}

/// The book after [`account`], and what was added per series.
#[derive(Debug, Clone, PartialEq)]
pub struct Accounted {
    pub book: Book,
    pub added: BTreeMap<Series, Totals>,
}

const DAY_MS: i64 = 86_400_000;

/// Adds to `book` each pod's time in `[watermark, upto)` (ms since the epoch) times its rate,
/// split by UTC day, under its namespace, each GpuQuota of its namespace (`quotas`, by
/// namespace), and each owner label value; the watermark becomes `upto`. A new book (no
/// watermark) counts pods from their start. `upto` at or before the watermark adds nothing.
pub fn account<'a>(
    book: &Book,
    pods: impl IntoIterator<Item = &'a Metered>,
    quotas: &BTreeMap<String, Vec<String>>,
    upto: i64,
    settings: &HoursSettings,
) -> Accounted {
    let from = book.watermark().unwrap_or(i64::MIN);
    let mut out = Accounted {
        book: book.clone(),
        added: BTreeMap::new(),
    };
    if upto <= from {
        return out;
    }
    // Per (day, namespace, owners): pods of one tenant summed before any key is built.
    let mut tenants: HashMap<(i64, &str, &[String]), Totals> = HashMap::new();
    for p in pods {
        let a = p.interval.start.max(from);
        let b = p.interval.end.unwrap_or(upto).min(upto);
        let mut t = a;
        while t < b {
            let day = t.div_euclid(DAY_MS);
            let next = ((day + 1) * DAY_MS).min(b);
            let secs = (next - t) as f64 / 1000.0;
            let e = tenants.entry((day, &p.namespace, &p.owners)).or_default();
            e.gpu_seconds += secs * p.rate.gpus;
            e.gpu_memory_byte_seconds += secs * p.rate.gpu_memory;
            t = next;
        }
    }
    let tenants = tenants
        .into_iter()
        .map(|((day, ns, owners), t)| ((day, ns.to_string(), owners.to_vec()), t));
    book_tenants(&mut out, tenants, quotas, settings);
    out.book.set_watermark(upto);
    out.book.trim(upto, settings.retention_days);
    out
}

/// Adds each tenant's totals of a day to the book under its namespace, each GpuQuota of its
/// namespace and each owner label value, and to the counters' increments.
fn book_tenants(
    out: &mut Accounted,
    tenants: impl Iterator<Item = ((i64, String, Vec<String>), Totals)>,
    quotas: &BTreeMap<String, Vec<String>>,
    settings: &HoursSettings,
) {
    let none = Vec::new();
    for ((day, ns, owners), totals) in tenants {
        let qs = quotas.get(&ns).unwrap_or(&none);
        for q in qs {
            let series = Series::Quota {
                namespace: ns.clone(),
                quota: q.clone(),
            };
            *out.added.entry(series).or_default() += totals;
        }
        let keys = std::iter::once(Key::Namespace(ns.clone()))
            .chain(qs.iter().map(|q| Key::Quota(ns.clone(), q.clone())))
            .chain(
                settings
                    .owner_labels
                    .iter()
                    .zip(&owners)
                    .map(|(k, v)| Key::Owner(ns.clone(), k.clone(), v.clone())),
            );
        out.book.add(day * DAY_MS, keys, totals);
        let series = Series::Tenant {
            namespace: ns,
            owners,
        };
        *out.added.entry(series).or_default() += totals;
    }
}

#[cfg(test)]
mod tests;
