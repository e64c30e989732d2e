//! Busy GPU time and peak GPU memory (pure): the agents export, per device and holder, a
//! counter of utilization-weighted busy seconds (`gpuplane_container_gpu_busy_seconds_total`)
//! and a gauge of the memory the holder's processes use; Prometheus keeps their samples, and
//! the shell hands this module the raw samples of one window `(from, to]` ([`busy_window`]).
//!
//! No double count: every increment between two samples of a series is booked on the day of
//! the later sample, once, by the window that holds that sample; windows follow the book's own
//! busy watermark and never overlap. Raw samples, not `increase()`, which extrapolates to the
//! window's edges. A counter that went down restarted (an agent restart) from 0, so its new
//! value is all new; a series with no sample in the [`LOOKBACK_MS`] before the window started
//! from 0 only if its pod is that young, else its first value is left out (it was counted
//! before, or was missed while Prometheus was away): undercounting by at most one sample's
//! increment rather than counting anything twice.

use super::{book_tenants, Accounted, Book, HoursSettings, Metered, Totals, DAY_MS};
use std::collections::{BTreeMap, HashMap};

/// How far before the window the shell asks for samples: the sample before the watermark is
/// the base of the first increment (Prometheus' own lookback for an instant vector is 5m).
pub const LOOKBACK_MS: i64 = 300_000;
/// The longest window one flush accounts: after an outage, busy time catches up an hour per
/// flush, so no query asks Prometheus for more than an hour of samples.
pub const MAX_BUSY_WINDOW_MS: i64 = 3_600_000;

/// One series' samples, in time order: `(ms since the epoch, value)`.
#[derive(Debug, Clone, PartialEq)]
pub struct PodSeries {
    pub namespace: String,
    pub pod: String,
    pub points: Vec<(i64, f64)>,
}

/// The window `(from, to]` the next busy accounting covers, `None` when there is none: from
/// the busy watermark (a book that never measured starts [`MAX_BUSY_WINDOW_MS`] before
/// `upto`), at most [`MAX_BUSY_WINDOW_MS`] long.
pub fn busy_window(book: &Book, upto: i64) -> Option<(i64, i64)> {
    let from = book
        .busy_watermark()
        .unwrap_or(upto.saturating_sub(MAX_BUSY_WINDOW_MS));
    let to = upto.min(from.saturating_add(MAX_BUSY_WINDOW_MS));
    (to > from).then_some((from, to))
}

/// Adds to `book` the busy seconds and peak memory of `(from, to]` per tenant (namespace,
/// its GpuQuotas, owner label values from the pod's view in `pods`; a pod no longer known
/// has no owner values), and moves the busy watermark to `to`.
pub fn account_busy<'a>(
    book: &Book,
    busy: &[PodSeries],
    memory: &[PodSeries],
    pods: impl IntoIterator<Item = &'a Metered>,
    quotas: &BTreeMap<String, Vec<String>>,
    (from, to): (i64, i64),
    settings: &HoursSettings,
) -> Accounted {
    let mut out = Accounted {
        book: book.clone(),
        added: BTreeMap::new(),
    };
    if to <= from || book.busy_watermark().is_some_and(|w| w >= to) {
        return out;
    }
    let views: HashMap<(&str, &str), &Metered> = pods
        .into_iter()
        .map(|m| ((m.namespace.as_str(), m.pod.as_str()), m))
        .collect();
    let none = vec![String::new(); settings.owner_labels.len()];
    let owners = |ns: &str, pod: &str| {
        views
            .get(&(ns, pod))
            .map_or_else(|| none.clone(), |m| m.owners.clone())
    };
    let mut tenants: BTreeMap<(i64, String, Vec<String>), Totals> = BTreeMap::new();
    for s in busy {
        let young = views
            .get(&(s.namespace.as_str(), s.pod.as_str()))
            .is_some_and(|m| m.interval.start > from - LOOKBACK_MS);
        for (t, delta) in increments(&s.points, from, to, young) {
            let key = (
                t.div_euclid(DAY_MS),
                s.namespace.clone(),
                owners(&s.namespace, &s.pod),
            );
            tenants.entry(key).or_default().busy_gpu_seconds += delta;
        }
    }
    // The memory one pod used at once: its series summed per scrape (one target's series share
    // the scrape's timestamp), then the largest per day.
    let mut per_pod: BTreeMap<(&str, &str), BTreeMap<i64, f64>> = BTreeMap::new();
    for s in memory {
        let at = per_pod.entry((&s.namespace, &s.pod)).or_default();
        for &(t, v) in s.points.iter().filter(|(t, _)| *t > from && *t <= to) {
            *at.entry(t).or_default() += v;
        }
    }
    for ((ns, pod), at) in per_pod {
        for (t, v) in at {
            let key = (t.div_euclid(DAY_MS), ns.to_string(), owners(ns, pod));
            let e = tenants.entry(key).or_default();
            e.peak_gpu_memory_bytes = e.peak_gpu_memory_bytes.max(v);
        }
    }
    book_tenants(&mut out, tenants.into_iter(), quotas, settings);
    out.book.set_busy_watermark(to);
    out.book.trim(to, settings.retention_days);
    out
}

/// A counter's increments at its samples inside `(from, to]`: the difference from the sample
/// before, the whole value after a reset, and the first value of a series with no sample
/// before only when it is `young` (started from 0 within the window).
fn increments(points: &[(i64, f64)], from: i64, to: i64, young: bool) -> Vec<(i64, f64)> {
    let mut out = Vec::new();
    let mut prev: Option<f64> = None;
    for &(t, v) in points {
        if t > to {
            break;
        }
        if t > from {
            let delta = match prev {
                Some(p) if v >= p => v - p,
                Some(_) => v,
                None if young => v,
                None => 0.0,
            };
            if delta > 0.0 {
                out.push((t, delta));
            }
        }
        prev = Some(v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::hours::{By, Interval, Rate};

    const T0: i64 = 1_796_000_000_000;

    fn settings() -> HoursSettings {
        HoursSettings {
            owner_labels: vec!["team".into()],
            ..HoursSettings::default()
        }
    }

    fn view(pod: &str, start: i64, team: &str) -> Metered {
        Metered {
            namespace: "ml".into(),
            pod: pod.into(),
            interval: Interval { start, end: None },
            rate: Rate {
                gpus: 1.0,
                gpu_memory: 0.0,
            },
            owners: vec![team.into()],
        }
    }

    fn series(pod: &str, points: &[(i64, f64)]) -> PodSeries {
        PodSeries {
            namespace: "ml".into(),
            pod: pod.into(),
            points: points.iter().map(|&(s, v)| (T0 + s * 1000, v)).collect(),
        }
    }

    fn busy_of(book: &Book, by: By, tenant: &str) -> f64 {
        let r = book.report(&by, None, None, None);
        r.rows
            .iter()
            .find(|r| r.tenant == tenant)
            .map_or(0.0, |r| r.busy_gpu_seconds)
    }

    #[test]
    fn adjacent_windows_count_each_increment_once_across_an_agent_restart() {
        let pods = [view("p", T0 - 600_000, "a")];
        // 0.8 busy seconds per second, sampled every 10 s; the agent restarts after 40 s and
        // its counter starts over (the sample at 50 s is 8: 10 s at 80% since the restart).
        let s = series(
            "p",
            &[
                (0, 100.0),
                (10, 108.0),
                (20, 116.0),
                (30, 124.0),
                (40, 132.0),
                (50, 8.0),
                (60, 16.0),
            ],
        );
        let q = BTreeMap::new();
        let mut book = Book::default();
        for (a, b) in [(0, 25), (25, 60)] {
            let w = (T0 + a * 1000, T0 + b * 1000);
            let samples: Vec<PodSeries> = vec![PodSeries {
                points: s
                    .points
                    .iter()
                    .copied()
                    .filter(|(t, _)| *t > w.0 - LOOKBACK_MS && *t <= w.1)
                    .collect(),
                ..s.clone()
            }];
            book = account_busy(&book, &samples, &[], &pods, &q, w, &settings()).book;
        }
        // 6 increments of 8: 10, 20 | 30, 40, the reset at 50 (all 8 new), 60.
        assert!((busy_of(&book, By::Namespace, "ml") - 48.0).abs() < 1e-9);
        assert!((busy_of(&book, By::Owner("team".into()), "a") - 48.0).abs() < 1e-9);
        assert_eq!(book.busy_watermark(), Some(T0 + 60_000));
        // The same window again adds nothing.
        let again = account_busy(&book, &[s], &[], &pods, &q, (T0, T0 + 60_000), &settings());
        assert_eq!(again.book, book);
    }

    #[test]
    fn a_first_sample_counts_whole_only_for_a_young_pod() {
        let w = (T0, T0 + 60_000);
        let q = BTreeMap::new();
        // Started 20 s into the window: its counter's first value is its own.
        let young = [view("new", T0 + 20_000, "a")];
        let out = account_busy(
            &Book::default(),
            &[series("new", &[(30, 5.0), (40, 13.0)])],
            &[],
            &young,
            &q,
            w,
            &settings(),
        );
        assert!((busy_of(&out.book, By::Namespace, "ml") - 13.0).abs() < 1e-9);
        // Running for an hour, first seen now (Prometheus was away): only what follows counts.
        let old = [view("old", T0 - 3_600_000, "a")];
        let out = account_busy(
            &Book::default(),
            &[series("old", &[(30, 500.0), (40, 508.0)])],
            &[],
            &old,
            &q,
            w,
            &settings(),
        );
        assert!((busy_of(&out.book, By::Namespace, "ml") - 8.0).abs() < 1e-9);
    }

    #[test]
    fn peak_memory_is_the_most_one_pod_used_at_once_under_its_quota_and_owner() {
        let pods = [view("p", T0 - 600_000, "a"), view("r", T0 - 600_000, "b")];
        let mut q = BTreeMap::new();
        q.insert("ml".to_string(), vec!["default".to_string()]);
        // Pod p on two GPUs: 3 + 2 at once at 20 s; pod r peaks at 4; a sample outside the
        // window is not counted.
        let memory = [
            series("p", &[(10, 1.0), (20, 3.0), (90, 50.0)]),
            series("p", &[(10, 1.0), (20, 2.0)]),
            series("r", &[(20, 4.0)]),
            // A pod the controller does not know: its namespace counts it, no owner value.
            series("gone", &[(20, 7.0)]),
        ];
        let out = account_busy(
            &Book::default(),
            &[],
            &memory,
            &pods,
            &q,
            (T0, T0 + 60_000),
            &settings(),
        );
        let peak = |by: By, t: &str| {
            let r = out.book.report(&by, None, None, None);
            r.rows
                .iter()
                .find(|r| r.tenant == t)
                .map(|r| r.peak_gpu_memory_bytes)
        };
        assert_eq!(peak(By::Owner("team".into()), "a"), Some(5.0));
        assert_eq!(peak(By::Owner("team".into()), "b"), Some(4.0));
        assert_eq!(peak(By::Owner("team".into()), "(none)"), Some(7.0));
        assert_eq!(peak(By::Namespace, "ml"), Some(7.0));
        assert_eq!(peak(By::Quota, "ml/default"), Some(7.0));
        // Busy time and peak memory leave the allocated totals and watermark alone.
        assert_eq!(out.book.watermark(), None);
        assert_eq!(
            out.book.report(&By::Namespace, None, None, None).rows[0].gpu_seconds,
            0.0
        );
    }

    #[test]
    fn the_window_follows_the_busy_watermark_an_hour_at_most() {
        assert_eq!(
            busy_window(&Book::default(), T0),
            Some((T0 - MAX_BUSY_WINDOW_MS, T0))
        );
        let mut book = Book::default();
        book.set_busy_watermark(T0 - 5 * MAX_BUSY_WINDOW_MS);
        assert_eq!(
            busy_window(&book, T0),
            Some((T0 - 5 * MAX_BUSY_WINDOW_MS, T0 - 4 * MAX_BUSY_WINDOW_MS))
        );
        book.set_busy_watermark(T0);
        assert_eq!(busy_window(&book, T0), None);
    }
}
