use super::*;
use crate::quota::{Gpus, Memory};
use serde_json::json;

const T0: i64 = 1_796_000_000_000; // 2026-11-30T...Z, a round base
const GIB: f64 = (1u64 << 30) as f64;

fn settings() -> HoursSettings {
    HoursSettings {
        owner_labels: vec!["team".into()],
        ..HoursSettings::default()
    }
}

fn metered(ns: &str, start: i64, end: Option<i64>, gpus: f64, mem_gib: f64, team: &str) -> Metered {
    Metered {
        namespace: ns.into(),
        pod: format!("{ns}-{start}"),
        interval: Interval { start, end },
        rate: Rate {
            gpus,
            gpu_memory: mem_gib * GIB,
        },
        owners: vec![team.into()],
    }
}

fn quotas(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (ns, q) in pairs {
        m.entry(ns.to_string()).or_default().push(q.to_string());
    }
    m
}

fn total(book: &Book, by: By, tenant: &str) -> Totals {
    let r = book.report(&by, None, None, None);
    r.rows
        .iter()
        .find(|r| r.tenant == tenant)
        .map(|r| Totals {
            gpu_seconds: r.gpu_seconds,
            gpu_memory_byte_seconds: r.gpu_memory_byte_seconds,
            ..Totals::default()
        })
        .unwrap_or_default()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[test]
fn known_lifetimes_give_exact_totals_per_namespace_quota_and_owner() {
    let pods = [
        metered("a", T0, Some(T0 + 20_000), 1.0, 80.0, "ml"),
        metered("a", T0 + 5_000, Some(T0 + 45_000), 1.0, 80.0, "ml"),
        // A MIG 1g.10gb slice of a 7-slice GPU, still running.
        metered("b", T0, None, 1.0 / 7.0, 10.0, ""),
    ];
    let q = quotas(&[("a", "default"), ("a", "burst")]);
    let out = account(&Book::default(), &pods, &q, T0 + 70_000, &settings());
    let a = total(&out.book, By::Namespace, "a");
    assert!(close(a.gpu_seconds, 60.0), "{a:?}");
    assert!(close(a.gpu_memory_byte_seconds, 60.0 * 80.0 * GIB));
    for quota in ["a/default", "a/burst"] {
        assert!(close(total(&out.book, By::Quota, quota).gpu_seconds, 60.0));
    }
    assert!(close(
        total(&out.book, By::Namespace, "b").gpu_seconds,
        10.0
    ));
    assert!(close(
        total(&out.book, By::Owner("team".into()), "ml").gpu_seconds,
        60.0
    ));
    assert!(close(
        total(&out.book, By::Owner("team".into()), "(none)").gpu_seconds,
        10.0
    ));
    assert_eq!(out.book.watermark(), Some(T0 + 70_000));
    // The counters' increments carry the same amounts.
    let tenant = Series::Tenant {
        namespace: "a".into(),
        owners: vec!["ml".into()],
    };
    assert!(close(out.added[&tenant].gpu_seconds, 60.0));
    assert_eq!(out.added.len(), 4, "{:?}", out.added.keys());
}

#[test]
fn a_restart_continues_from_the_watermark_without_counting_twice() {
    let pods = [
        metered("a", T0, Some(T0 + 20_000), 1.0, 1.0, "x"),
        metered("a", T0, None, 0.5, 1.0, "x"),
    ];
    let q = quotas(&[]);
    let s = settings();
    let once = account(&Book::default(), &pods, &q, T0 + 60_000, &s).book;
    // Three flushes, the book re-read from its JSON between them (a restart, a new leader).
    let mut book = Book::default();
    for upto in [T0 + 7_000, T0 + 33_000, T0 + 60_000] {
        book = Book::from_json(&account(&book, &pods, &q, upto, &s).book.to_json()).unwrap();
    }
    let (a, b) = (
        total(&once, By::Namespace, "a"),
        total(&book, By::Namespace, "a"),
    );
    assert!(close(a.gpu_seconds, 20.0 + 30.0) && close(b.gpu_seconds, a.gpu_seconds));
    // A second writer that lost the race re-reads and accounts again: nothing is added.
    let again = account(&book, &pods, &q, T0 + 60_000, &s);
    assert_eq!(again.book, book);
    assert!(again.added.is_empty());
}

#[test]
fn a_pod_that_ended_while_no_controller_watched_is_counted_from_its_own_times() {
    let s = settings();
    let q = quotas(&[]);
    let running = [metered("a", T0, None, 1.0, 1.0, "x")];
    let book = account(&Book::default(), &running, &q, T0 + 10_000, &s).book;
    // Down from +10 s to +100 s; the pod finished at +40 s and is still listed.
    let done = [metered("a", T0, Some(T0 + 40_000), 1.0, 1.0, "x")];
    let book = account(&book, &done, &q, T0 + 100_000, &s).book;
    assert!(close(total(&book, By::Namespace, "a").gpu_seconds, 40.0));
}

#[test]
fn time_across_midnight_is_split_by_utc_day_and_period_totals_take_the_month() {
    let midnight = (T0 / DAY_MS + 1) * DAY_MS;
    let pods = [metered("a", midnight - 3_600_000, None, 2.0, 0.0, "x")];
    let q = quotas(&[("a", "default")]);
    let book = account(
        &Book::default(),
        &pods,
        &q,
        midnight + 7_200_000,
        &settings(),
    )
    .book;
    let (before, after) = (day_of(midnight - 1), day_of(midnight));
    let day = |d: &str| book.report(&By::Namespace, None, Some(d), None).rows[0].gpu_hours;
    assert!(close(day(&before), 6.0) && close(day(&after), 4.0));
    let key = Key::Quota("a".into(), "default".into());
    let (p0, p1) = (period_of(midnight - 1), period_of(midnight));
    if p0 == p1 {
        assert!(close(
            book.period_totals(&key, &p1).gpu_seconds,
            6.0 * 3600.0
        ));
    } else {
        assert!(close(
            book.period_totals(&key, &p1).gpu_seconds,
            4.0 * 3600.0
        ));
        assert!(close(
            book.period_totals(&key, &p0).gpu_seconds,
            2.0 * 3600.0
        ));
    }
    let window = book.report(&By::Namespace, None, Some(&after), Some(&after));
    assert!(window.rows.is_empty(), "until is excluded");
}

#[test]
fn an_upto_before_the_watermark_adds_nothing() {
    let pods = [metered("a", T0, None, 1.0, 1.0, "x")];
    let book = account(
        &Book::default(),
        &pods,
        &quotas(&[]),
        T0 + 10_000,
        &settings(),
    )
    .book;
    let out = account(&book, &pods, &quotas(&[]), T0 + 5_000, &settings());
    assert_eq!(out.book, book);
}

fn pod(status: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "a", "labels": {"team": "ml"}},
        "status": status,
    }))
    .unwrap()
}

fn ms(t: &str) -> i64 {
    t.parse::<k8s_openapi::jiff::Timestamp>()
        .unwrap()
        .as_millisecond()
}

#[test]
fn the_run_interval_is_read_from_container_statuses() {
    let running = pod(json!({"phase": "Running", "containerStatuses": [
        {"name": "a", "image": "i", "imageID": "", "ready": true, "restartCount": 1,
         "state": {"running": {"startedAt": "2026-12-01T10:00:30Z"}},
         "lastState": {"terminated": {"exitCode": 1, "startedAt": "2026-12-01T10:00:00Z",
                                      "finishedAt": "2026-12-01T10:00:20Z"}}},
    ]}));
    let i = run_interval(&running).unwrap();
    assert_eq!(i.start, ms("2026-12-01T10:00:00Z"));
    assert_eq!(i.end, None);
    let done = pod(json!({"phase": "Succeeded", "containerStatuses": [
        {"name": "a", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
         "state": {"terminated": {"exitCode": 0, "startedAt": "2026-12-01T10:00:00Z",
                                  "finishedAt": "2026-12-01T10:00:20Z"}}},
        {"name": "b", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
         "state": {"terminated": {"exitCode": 0, "startedAt": "2026-12-01T10:00:01Z",
                                  "finishedAt": "2026-12-01T10:00:40Z"}}},
    ]}));
    let i = run_interval(&done).unwrap();
    assert_eq!(i.end, Some(ms("2026-12-01T10:00:40Z")));
    assert!(run_interval(&pod(json!({"phase": "Pending"}))).is_none());
    // Failed with no finish recorded (its node was lost): ends at its last condition change.
    let lost = pod(json!({"phase": "Failed",
        "conditions": [{"type": "Ready", "status": "False",
                        "lastTransitionTime": "2026-12-01T11:00:00Z"}],
        "containerStatuses": [
        {"name": "a", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
         "state": {"running": {"startedAt": "2026-12-01T10:00:00Z"}}},
    ]}));
    assert_eq!(
        run_interval(&lost).unwrap().end,
        Some(ms("2026-12-01T11:00:00Z"))
    );
}

#[test]
fn a_pod_is_metered_at_its_quota_charge_with_its_owner_labels() {
    let p = pod(json!({"phase": "Running", "containerStatuses": [
        {"name": "a", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
         "state": {"running": {"startedAt": "2026-12-01T10:00:00Z"}}}]}));
    let charge = Usage {
        gpus: Gpus::new(2, 7).unwrap(),
        gpu_memory: Memory(20 << 30),
        ..Usage::default()
    };
    let m = Metered::of(&p, &charge, &["team".into(), "cost-center".into()]).unwrap();
    assert!(close(m.rate.gpus, 2.0 / 7.0));
    assert_eq!(m.owners, ["ml", ""]);
    assert!(Metered::of(&p, &Usage::default(), &[]).is_none());
}

#[test]
fn the_book_round_trips_and_stays_bounded() {
    let mut s = settings();
    let pods: Vec<Metered> = (0..MAX_KEYS_PER_DAY + 10)
        .map(|i| metered("a", T0, None, 1.0, 0.0, &format!("t{i}")))
        .collect();
    let book = account(&Book::default(), &pods, &quotas(&[]), T0 + 1_000, &s).book;
    let back = Book::from_json(&book.to_json()).unwrap();
    assert_eq!(back, book);
    let other = total(&book, By::Owner("team".into()), OTHER);
    assert!(other.gpu_seconds >= 10.0, "{other:?}");
    assert!(book.to_json().len() <= MAX_BOOK_BYTES);
    // Retention: a day older than it is folded into its month at the next flush; a window
    // that holds the whole month counts it, one that cuts the month names it.
    s.retention_days = 1;
    let later = T0 + 3 * DAY_MS;
    let folded = account(&book, &[], &quotas(&[]), later, &s).book;
    assert!(close(
        total(&folded, By::Namespace, "a").gpu_seconds,
        pods.len() as f64
    ));
    let cut = folded.report(&By::Namespace, None, Some(&day_of(T0)), None);
    assert!(
        cut.rows.is_empty() && cut.cut_months == [period_of(T0)],
        "{cut:?}"
    );
    assert!(Book::from_json("{\"accountedUntil\": \"yesterday\"}").is_err());
}

#[test]
fn keys_and_days_parse_back() {
    for k in [
        Key::Namespace("a".into()),
        Key::Quota("a".into(), "q".into()),
        Key::Owner("a".into(), "example.com/team".into(), "ml".into()),
        Key::Owner("a".into(), "team".into(), String::new()),
    ] {
        assert_eq!(Key::parse(&k.to_string()), Some(k));
    }
    assert_eq!(parse_day("2026-12-03").unwrap(), "2026-12-03");
    assert_eq!(parse_day("2026-12-03T23:59:00Z").unwrap(), "2026-12-03");
    assert!(parse_day("yesterday").is_err());
}

#[test]
fn a_quota_status_shows_its_totals_in_the_watermarks_month() {
    use crate::quota::GpuQuota;
    let quota: GpuQuota = serde_json::from_value(json!({
        "apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "default", "namespace": "a"},
        "spec": {"hard": {"gpus": "4"}},
    }))
    .unwrap();
    assert_eq!(Book::default().quota_status(&quota), None);
    let pods = [metered("a", T0, Some(T0 + 30_000), 0.5, 40.0, "x")];
    let q = quotas(&[("a", "default")]);
    let book = account(&Book::default(), &pods, &q, T0 + 60_000, &settings()).book;
    let s = book.quota_status(&quota).unwrap();
    assert_eq!(s.period, period_of(T0 + 60_000));
    assert!(close(s.gpu_seconds, 15.0) && close(s.gpu_memory_byte_seconds, 30.0 * 40.0 * GIB));
}

#[test]
fn a_book_over_its_size_folds_its_oldest_days_into_months_and_keeps_the_totals() {
    let s = settings();
    let q = quotas(&[("a", "default")]);
    // 2026-12-01: four days of a full day's keys each, more than the book may hold by day.
    let start = 1_796_083_200_000;
    let pods: Vec<Metered> = (0..MAX_KEYS_PER_DAY)
        .map(|i| metered("a", start, None, 1.0, 0.0, &format!("team-number-{i}")))
        .collect();
    let mut book = Book::default();
    for d in 1..=4 {
        book = account(&book, &pods, &q, start + d * DAY_MS, &s).book;
    }
    let json = book.to_json();
    assert!(json.len() <= MAX_BOOK_BYTES, "{} bytes", json.len());
    assert!(json.contains("\"months\""), "days were folded");
    let want = pods.len() as f64 * 4.0 * 86_400.0;
    let key = Key::Quota("a".into(), "default".into());
    let month = book.period_totals(&key, "2026-12").gpu_seconds;
    assert!(close(month, want), "{month} vs {want}");
    assert!(close(total(&book, By::Namespace, "a").gpu_seconds, want));
}
