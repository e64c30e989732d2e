//! The ledger's durable record (pure): a [`Book`] holds the watermark (`accountedUntil`) and,
//! per UTC day, GPU-seconds and GPU-memory-byte-seconds per [`Key`] (a namespace, a GpuQuota,
//! an owner label value). It is stored as JSON in one ConfigMap, so it is bounded: at most
//! [`MAX_KEYS_PER_DAY`] keys a bucket (further owner values fold into [`OTHER`]); days older
//! than the retention, and then the oldest days while the book is larger than
//! [`MAX_BOOK_BYTES`], fold into monthly totals (so a month's total is never lost to size);
//! past [`MAX_MONTHS`] months, or still too large, the oldest months go. [`Book::report`] sums
//! it per tenant over a window of days.

use crate::quota::{GpuHoursStatus, GpuQuota};
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Keys a day holds at most; an owner label value beyond them is booked as [`OTHER`].
pub const MAX_KEYS_PER_DAY: usize = 4000;
/// The book's JSON is kept under this size (a ConfigMap holds at most 1 MiB).
pub const MAX_BOOK_BYTES: usize = 900 * 1024;
/// Monthly totals kept at most.
pub const MAX_MONTHS: usize = 24;
/// The owner label value that stands for the values past [`MAX_KEYS_PER_DAY`].
pub const OTHER: &str = "_other";

/// GPU-seconds (whole-GPU equivalents) and GPU-memory-byte-seconds held; busy GPU-seconds
/// (utilization-weighted, from the agents' telemetry) and the peak GPU memory one pod used.
/// Stored as `[gpuSeconds, gpuMemoryByteSeconds]`, or with `busyGpuSeconds, peakGpuMemoryBytes`
/// appended once either is measured, to keep the book small (a book written before busy time
/// was measured reads as none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "Vec<f64>", into = "Vec<f64>")]
pub struct Totals {
    pub gpu_seconds: f64,
    pub gpu_memory_byte_seconds: f64,
    pub busy_gpu_seconds: f64,
    /// A maximum, not a sum: adding totals keeps the larger.
    pub peak_gpu_memory_bytes: f64,
}

impl From<Vec<f64>> for Totals {
    fn from(v: Vec<f64>) -> Totals {
        let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
        Totals {
            gpu_seconds: at(0),
            gpu_memory_byte_seconds: at(1),
            busy_gpu_seconds: at(2),
            peak_gpu_memory_bytes: at(3),
        }
    }
}

impl From<Totals> for Vec<f64> {
    fn from(t: Totals) -> Vec<f64> {
        let mut v = vec![t.gpu_seconds, t.gpu_memory_byte_seconds];
        if t.busy_gpu_seconds != 0.0 || t.peak_gpu_memory_bytes != 0.0 {
            v.extend([t.busy_gpu_seconds, t.peak_gpu_memory_bytes]);
        }
        v
    }
}

impl std::ops::AddAssign for Totals {
    fn add_assign(&mut self, o: Totals) {
        self.gpu_seconds += o.gpu_seconds;
        self.gpu_memory_byte_seconds += o.gpu_memory_byte_seconds;
        self.busy_gpu_seconds += o.busy_gpu_seconds;
        self.peak_gpu_memory_bytes = self.peak_gpu_memory_bytes.max(o.peak_gpu_memory_bytes);
    }
}

/// What a total is booked under; written `NS`, `NS/quota/NAME` or `NS/label/KEY=VALUE` (none
/// of the parts may contain the separators where they are split: namespaces have no `/`,
/// label keys and values no `=`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    Namespace(String),
    Quota(String, String),
    /// Namespace, label key, value (`""`: the pod has no such label).
    Owner(String, String, String),
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Namespace(ns) => f.write_str(ns),
            Key::Quota(ns, q) => write!(f, "{ns}/quota/{q}"),
            Key::Owner(ns, k, v) => write!(f, "{ns}/label/{k}={v}"),
        }
    }
}

impl Key {
    /// Reads a key as [`fmt::Display`] writes it; `None` for a shape this version does not
    /// know (a newer controller's), which reports skip.
    pub fn parse(s: &str) -> Option<Key> {
        let Some((ns, rest)) = s.split_once('/') else {
            return Some(Key::Namespace(s.to_string()));
        };
        if let Some(q) = rest.strip_prefix("quota/") {
            return Some(Key::Quota(ns.into(), q.into()));
        }
        let (k, v) = rest.strip_prefix("label/")?.rsplit_once('=')?;
        Some(Key::Owner(ns.into(), k.into(), v.into()))
    }

    pub fn namespace(&self) -> &str {
        match self {
            Key::Namespace(ns) | Key::Quota(ns, _) | Key::Owner(ns, _, _) => ns,
        }
    }
}

/// Why a stored book cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum BookError {
    #[error("the GPU-hours book is not valid JSON ({0}); delete it to start a new one, or restore it from a backup")]
    Json(#[from] serde_json::Error),
    #[error("{0:?} is not a day (YYYY-MM-DD) or an RFC 3339 time")]
    Day(String),
}

/// The ledger's record: the watermark and the totals per day and key.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Book {
    /// Everything before this is counted (RFC 3339, milliseconds).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "watermark")]
    accounted_until: Option<i64>,
    /// Busy time and peak memory are counted before this (their own watermark: they come from
    /// Prometheus, which may be unreachable while the allocated time goes on).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "watermark")]
    busy_until: Option<i64>,
    /// Totals per UTC day (`YYYY-MM-DD`) and key ([`Key`]'s text).
    #[serde(default)]
    days: BTreeMap<String, Bucket>,
    /// Days folded by month (`YYYY-MM`): older than the retention, or the book was too large.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    months: BTreeMap<String, Bucket>,
}

/// One day's or month's totals by key.
type Bucket = BTreeMap<String, Totals>;

/// Adds `totals` under `key`; an owner key new to a full bucket goes under [`OTHER`].
fn add_to(bucket: &mut Bucket, key: &Key, totals: Totals) {
    let mut text = key.to_string();
    if let Key::Owner(ns, k, _) = key {
        if bucket.len() >= MAX_KEYS_PER_DAY && !bucket.contains_key(&text) {
            text = Key::Owner(ns.clone(), k.clone(), OTHER.into()).to_string();
        }
    }
    *bucket.entry(text).or_default() += totals;
}

/// About how many bytes of JSON a bucket takes (a key's entry is its text, quotes, and four
/// numbers of at most 24 characters).
fn bucket_size(b: &Bucket) -> usize {
    16 + b.keys().map(|k| k.len() + 106).sum::<usize>()
}

/// The first day after month `YYYY-MM` (`YYYY-MM-DD`), for comparing with days.
fn month_end(month: &str) -> String {
    let (y, m) = month.split_once('-').unwrap_or((month, "12"));
    let (y, m): (u32, u32) = (y.parse().unwrap_or(0), m.parse().unwrap_or(12));
    if m >= 12 {
        format!("{:04}-01-01", y + 1)
    } else {
        format!("{y:04}-{:02}-01", m + 1)
    }
}

mod watermark {
    use k8s_openapi::jiff::Timestamp;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(ms: &Option<i64>, s: S) -> Result<S::Ok, S::Error> {
        match ms.map(Timestamp::from_millisecond) {
            Some(Ok(t)) => s.serialize_str(&format!("{t:.3}")),
            _ => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|t| {
            t.parse::<Timestamp>()
                .map(|t| t.as_millisecond())
                .map_err(|e| serde::de::Error::custom(format!("accountedUntil {t:?}: {e}")))
        })
        .transpose()
    }
}

/// A time in milliseconds since the epoch as RFC 3339 with milliseconds.
fn millis_text(ms: i64) -> String {
    Timestamp::from_millisecond(ms)
        .map(|t| format!("{t:.3}"))
        .unwrap_or_default()
}

/// The UTC day (`YYYY-MM-DD`) of a time in milliseconds since the epoch.
pub fn day_of(ms: i64) -> String {
    let t = Timestamp::from_millisecond(ms).unwrap_or(Timestamp::UNIX_EPOCH);
    let mut s = t.to_string();
    s.truncate(10);
    s
}

/// The calendar month (`YYYY-MM`) of a time in milliseconds since the epoch.
pub fn period_of(ms: i64) -> String {
    let mut s = day_of(ms);
    s.truncate(7);
    s
}

/// A day (`YYYY-MM-DD`) or an RFC 3339 time, as the UTC day it falls on.
pub fn parse_day(text: &str) -> Result<String, BookError> {
    let full = if text.len() == 10 {
        format!("{text}T00:00:00Z")
    } else {
        text.to_string()
    };
    let t: Timestamp = full.parse().map_err(|_| BookError::Day(text.into()))?;
    Ok(day_of(t.as_millisecond()))
}

impl Book {
    pub fn from_json(text: &str) -> Result<Book, BookError> {
        Ok(serde_json::from_str(text)?)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Everything before this time (ms since the epoch) is counted; `None` for a new book.
    pub fn watermark(&self) -> Option<i64> {
        self.accounted_until
    }

    pub(super) fn set_watermark(&mut self, ms: i64) {
        self.accounted_until = Some(ms);
    }

    /// Busy time and peak memory are counted before this; `None` until first measured.
    pub fn busy_watermark(&self) -> Option<i64> {
        self.busy_until
    }

    pub(super) fn set_busy_watermark(&mut self, ms: i64) {
        self.busy_until = Some(ms);
    }

    /// Adds `totals` under each of `keys` on the day starting at `day_ms`.
    pub(super) fn add(&mut self, day_ms: i64, keys: impl Iterator<Item = Key>, totals: Totals) {
        let day = self.days.entry(day_of(day_ms)).or_default();
        for key in keys {
            add_to(day, &key, totals);
        }
    }

    /// Folds the days more than `retention_days` before `now`'s into their months, then the
    /// oldest days while the book is larger than [`MAX_BOOK_BYTES`] (never the last day); then
    /// drops the oldest months past [`MAX_MONTHS`] or while still too large (never `now`'s).
    pub(super) fn trim(&mut self, now: i64, retention_days: u32) {
        let oldest = day_of(now - i64::from(retention_days) * 86_400_000);
        let mut size = self.size();
        while let Some(first) = self.days.first_key_value().map(|(d, _)| d.clone()) {
            let over = size > MAX_BOOK_BYTES && self.days.len() > 1;
            if first >= oldest && !over {
                break;
            }
            let Some(day) = self.days.remove(&first) else {
                break;
            };
            let month = self.months.entry(first[..7].to_string()).or_default();
            size -= bucket_size(month) + bucket_size(&day);
            for (text, t) in day {
                if let Some(key) = Key::parse(&text) {
                    add_to(month, &key, t);
                }
            }
            size += bucket_size(month);
        }
        let current = period_of(now);
        while self.months.len() > MAX_MONTHS || size > MAX_BOOK_BYTES {
            let Some((m, b)) = self.months.pop_first() else {
                break;
            };
            if m == current {
                self.months.insert(m, b);
                break;
            }
            size -= bucket_size(&b);
        }
    }

    /// About how many bytes of JSON the book takes.
    fn size(&self) -> usize {
        self.days
            .values()
            .chain(self.months.values())
            .map(|b| bucket_size(b) + 16)
            .sum::<usize>()
            + 64
    }

    /// A key's totals over the days of `period` (`YYYY-MM`), folded ones included.
    pub fn period_totals(&self, key: &Key, period: &str) -> Totals {
        let key = key.to_string();
        let mut sum = Totals::default();
        let days = self
            .days
            .range(format!("{period}-00")..format!("{period}-99"));
        for (_, b) in days.chain(self.months.get_key_value(period)) {
            if let Some(t) = b.get(&key) {
                sum += *t;
            }
        }
        sum
    }

    /// A GpuQuota's `status.gpuHours`: its totals in the watermark's month; `None` before the
    /// first flush.
    pub fn quota_status(&self, quota: &GpuQuota) -> Option<GpuHoursStatus> {
        let period = period_of(self.accounted_until?);
        let key = Key::Quota(
            quota.metadata.namespace.clone().unwrap_or_default(),
            quota.metadata.name.clone().unwrap_or_default(),
        );
        let t = self.period_totals(&key, &period);
        let busy = self.busy_until.is_some();
        Some(GpuHoursStatus {
            period,
            gpu_seconds: t.gpu_seconds,
            gpu_memory_byte_seconds: t.gpu_memory_byte_seconds,
            busy_gpu_seconds: busy.then_some(t.busy_gpu_seconds),
            peak_gpu_memory_bytes: busy.then_some(t.peak_gpu_memory_bytes),
            busy_counted_until: self.busy_until.map(millis_text),
        })
    }

    /// Totals per tenant over the days `since..until` (`YYYY-MM-DD`, `until` excluded; open
    /// ends take every day), of one namespace or all.
    pub fn report(
        &self,
        by: &By,
        namespace: Option<&str>,
        since: Option<&str>,
        until: Option<&str>,
    ) -> Report {
        let mut rows: BTreeMap<String, Totals> = BTreeMap::new();
        let days = self.days.iter().filter(|(d, _)| {
            since.is_none_or(|s| d.as_str() >= s) && until.is_none_or(|u| d.as_str() < u)
        });
        // A folded month counts when the window holds all of it; one it cuts is named.
        let mut cut_months = Vec::new();
        let months = self.months.iter().filter(|(m, _)| {
            let (first, end) = (format!("{m}-01"), month_end(m));
            let inside = since.is_none_or(|s| *s <= *first) && until.is_none_or(|u| *u >= *end);
            let apart = since.is_some_and(|s| *s >= *end) || until.is_some_and(|u| *u <= *first);
            if !inside && !apart {
                cut_months.push(m.to_string());
            }
            inside
        });
        for (_, day) in days.chain(months) {
            for (text, totals) in day {
                let Some(key) = Key::parse(text) else {
                    continue;
                };
                if namespace.is_some_and(|ns| ns != key.namespace()) {
                    continue;
                }
                let tenant = match (by, key) {
                    (By::Namespace, Key::Namespace(ns)) => ns,
                    (By::Quota, Key::Quota(ns, q)) => format!("{ns}/{q}"),
                    (By::Owner(want), Key::Owner(_, k, v)) if *want == k => {
                        if v.is_empty() {
                            "(none)".into()
                        } else {
                            v
                        }
                    }
                    _ => continue,
                };
                *rows.entry(tenant).or_default() += *totals;
            }
        }
        Report {
            by: by.to_string(),
            namespace: namespace.map(String::from),
            since: since.map(String::from),
            until: until.map(String::from),
            accounted_until: self.accounted_until.map(millis_text),
            busy_until: self.busy_until.map(millis_text),
            rows: rows.into_iter().map(ReportRow::new).collect(),
            cut_months,
        }
    }
}

/// What a report sums by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum By {
    Namespace,
    Quota,
    /// An owner label key the controller books (`--owner-label`).
    Owner(String),
}

impl fmt::Display for By {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            By::Namespace => f.write_str("namespace"),
            By::Quota => f.write_str("quota"),
            By::Owner(k) => f.write_str(k),
        }
    }
}

impl By {
    pub fn parse(text: &str) -> By {
        match text {
            "namespace" => By::Namespace,
            "quota" => By::Quota,
            k => By::Owner(k.into()),
        }
    }
}

/// Totals per tenant over a window (`gpuplane report`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub by: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// First day counted (UTC, included); none: the oldest day kept.
    pub since: Option<String>,
    /// First day not counted; none: up to `accountedUntil`.
    pub until: Option<String>,
    /// How far the book is counted.
    pub accounted_until: Option<String>,
    /// How far busy time and peak memory are counted; none: never measured (the controller
    /// has no `--prometheus-url`).
    pub busy_until: Option<String>,
    pub rows: Vec<ReportRow>,
    /// Months the book keeps only as monthly totals that the window cuts: left out.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cut_months: Vec<String>,
}

/// One tenant's totals.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReportRow {
    pub tenant: String,
    pub gpu_hours: f64,
    /// Utilization-weighted GPU-hours: what the held GPUs actually did.
    pub busy_gpu_hours: f64,
    pub gpu_memory_gib_hours: f64,
    /// The most GPU memory one pod of the tenant used at once, in GiB.
    pub peak_gpu_memory_gib: f64,
    pub gpu_seconds: f64,
    pub busy_gpu_seconds: f64,
    pub gpu_memory_byte_seconds: f64,
    pub peak_gpu_memory_bytes: f64,
}

impl ReportRow {
    fn new((tenant, t): (String, Totals)) -> ReportRow {
        let gib = (1u64 << 30) as f64;
        ReportRow {
            tenant,
            gpu_hours: t.gpu_seconds / 3600.0,
            busy_gpu_hours: t.busy_gpu_seconds / 3600.0,
            gpu_memory_gib_hours: t.gpu_memory_byte_seconds / 3600.0 / gib,
            peak_gpu_memory_gib: t.peak_gpu_memory_bytes / gib,
            gpu_seconds: t.gpu_seconds,
            busy_gpu_seconds: t.busy_gpu_seconds,
            gpu_memory_byte_seconds: t.gpu_memory_byte_seconds,
            peak_gpu_memory_bytes: t.peak_gpu_memory_bytes,
        }
    }
}

impl Report {
    /// The report as a table, one row per tenant.
    pub fn table(&self) -> String {
        let head = self.by.to_uppercase();
        let width = self
            .rows
            .iter()
            .map(|r| r.tenant.len())
            .chain([head.len()])
            .max()
            .unwrap_or(0);
        let mut out = format!(
            "{head:<width$}  {:>12}  {:>14}  {:>18}  {:>16}\n",
            "GPU-HOURS", "BUSY-GPU-HOURS", "GPU-MEM-GIB-HOURS", "PEAK-GPU-MEM-GIB"
        );
        let measured = self.busy_until.is_some();
        for r in &self.rows {
            let (busy, peak) = if measured {
                (
                    format!("{:.3}", r.busy_gpu_hours),
                    format!("{:.1}", r.peak_gpu_memory_gib),
                )
            } else {
                ("-".into(), "-".into())
            };
            out.push_str(&format!(
                "{:<width$}  {:>12.3}  {busy:>14}  {:>18.3}  {peak:>16}\n",
                r.tenant, r.gpu_hours, r.gpu_memory_gib_hours
            ));
        }
        out.push_str(&format!(
            "(days {} to {}, counted until {}; busy until {})\n",
            self.since.as_deref().unwrap_or("first kept"),
            self.until.as_deref().unwrap_or("now"),
            self.accounted_until.as_deref().unwrap_or("never"),
            self.busy_until
                .as_deref()
                .unwrap_or("never: the controller has no --prometheus-url")
        ));
        if !self.cut_months.is_empty() {
            out.push_str(&format!(
                "(left out: {}, kept only as monthly totals, which the window cuts)\n",
                self.cut_months.join(", ")
            ));
        }
        out
    }
}
