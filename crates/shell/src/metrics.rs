//! Prometheus metrics (text exposition format, `gpuplane_` prefix): a small process-wide
//! registry of counters and histograms, plus gauges the caller computes at scrape time.
//!
//! Process-wide like the Prometheus clients' default registry: the code that counts (a gRPC
//! handler, the ledger's caller) should not need a handle threaded through it.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Mutex, OnceLock};

/// Histogram buckets for call latencies, in seconds.
const BUCKETS: &[f64] = &[0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Hist {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Debug)]
struct Family {
    help: &'static str,
    kind: Kind,
    /// Histogram bucket bounds (the first observation's choice holds for the family).
    buckets: &'static [f64],
    values: BTreeMap<String, f64>,
    hists: BTreeMap<String, Hist>,
}

#[derive(Debug, Default)]
pub struct Registry {
    families: Mutex<BTreeMap<&'static str, Family>>,
}

/// The process-wide registry.
pub fn global() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(Registry::default)
}

/// Renders labels as `{a="x",b="y"}` with values escaped.
pub fn labels(pairs: &[(&str, &str)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| {
            format!(
                "{k}=\"{}\"",
                v.replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n")
            )
        })
        .collect();
    format!("{{{}}}", inner.join(","))
}

impl Registry {
    fn with(
        &self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        f: impl FnOnce(&mut Family),
    ) {
        let mut fams = self.families.lock().unwrap_or_else(|p| p.into_inner());
        let fam = fams.entry(name).or_insert_with(|| Family {
            help,
            kind,
            buckets: BUCKETS,
            values: BTreeMap::new(),
            hists: BTreeMap::new(),
        });
        f(fam);
    }

    /// Adds one to a counter.
    pub fn inc(&self, name: &'static str, help: &'static str, pairs: &[(&str, &str)]) {
        self.add(name, help, pairs, 1);
    }

    /// Adds `n` to a counter.
    pub fn add(&self, name: &'static str, help: &'static str, pairs: &[(&str, &str)], n: u64) {
        self.with(name, help, Kind::Counter, |f| {
            *f.values.entry(labels(pairs)).or_default() += n as f64
        });
    }

    /// Records one observation (seconds) in a latency histogram.
    pub fn observe(
        &self,
        name: &'static str,
        help: &'static str,
        pairs: &[(&str, &str)],
        seconds: f64,
    ) {
        self.observe_in(name, help, pairs, seconds, BUCKETS);
    }

    /// Records one observation in a histogram with its own bucket bounds (ascending), for
    /// values outside call latencies (e.g. minutes spent waiting in a queue).
    pub fn observe_in(
        &self,
        name: &'static str,
        help: &'static str,
        pairs: &[(&str, &str)],
        value: f64,
        buckets: &'static [f64],
    ) {
        self.with(name, help, Kind::Histogram, |f| {
            if f.hists.is_empty() {
                f.buckets = buckets;
            }
            let bounds = f.buckets;
            let h = f.hists.entry(labels(pairs)).or_insert_with(|| Hist {
                counts: vec![0; bounds.len()],
                ..Hist::default()
            });
            for (i, b) in bounds.iter().enumerate() {
                if value <= *b {
                    h.counts[i] += 1;
                }
            }
            h.sum += value;
            h.count += 1;
        });
    }

    /// The text exposition of every registered family.
    pub fn render(&self) -> String {
        let fams = self.families.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::new();
        for (name, f) in fams.iter() {
            let _ = writeln!(
                out,
                "# HELP {name} {}\n# TYPE {name} {}",
                f.help,
                f.kind.as_str()
            );
            for (l, v) in &f.values {
                let _ = writeln!(out, "{name}{l} {v}");
            }
            for (l, h) in &f.hists {
                let base = l.trim_start_matches('{').trim_end_matches('}');
                let sep = if base.is_empty() { "" } else { "," };
                for (b, c) in f.buckets.iter().zip(&h.counts) {
                    let _ = writeln!(out, "{name}_bucket{{{base}{sep}le=\"{b}\"}} {c}");
                }
                let _ = writeln!(out, "{name}_bucket{{{base}{sep}le=\"+Inf\"}} {}", h.count);
                let _ = writeln!(out, "{name}_sum{l} {}\n{name}_count{l} {}", h.sum, h.count);
            }
        }
        out
    }
}

/// A gauge computed at scrape time: name, help, and (rendered labels, value) per series.
pub type Gauge<'a> = (&'a str, &'a str, Vec<(String, f64)>);

/// Renders gauges computed at scrape time.
pub fn render_gauges(gauges: &[Gauge<'_>]) -> String {
    render_computed(Kind::Gauge, gauges)
}

/// Renders counters kept elsewhere (plain atomics) and read at scrape time.
pub fn render_counters(counters: &[Gauge<'_>]) -> String {
    render_computed(Kind::Counter, counters)
}

fn render_computed(kind: Kind, families: &[Gauge<'_>]) -> String {
    let mut out = String::new();
    for (name, help, series) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {}", kind.as_str());
        for (l, v) in series {
            let _ = writeln!(out, "{name}{l} {v}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_histograms_render_in_the_text_format() {
        let r = Registry::default();
        r.inc("gpuplane_test_total", "A test counter.", &[("api", "dra")]);
        r.inc("gpuplane_test_total", "A test counter.", &[("api", "dra")]);
        r.observe("gpuplane_test_seconds", "A test histogram.", &[], 0.003);
        let text = r.render();
        assert!(
            text.contains(
                "# TYPE gpuplane_test_total counter\ngpuplane_test_total{api=\"dra\"} 2\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("gpuplane_test_seconds_bucket{le=\"0.001\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("gpuplane_test_seconds_bucket{le=\"0.005\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("gpuplane_test_seconds_count 1\n"), "{text}");
        assert_eq!(labels(&[("m", "a\"b")]), "{m=\"a\\\"b\"}");
    }

    #[test]
    fn a_histogram_may_have_its_own_buckets() {
        let r = Registry::default();
        r.observe_in(
            "gpuplane_test_wait_seconds",
            "Waits.",
            &[("q", "a")],
            42.0,
            &[1.0, 60.0],
        );
        let text = r.render();
        for line in [
            "gpuplane_test_wait_seconds_bucket{q=\"a\",le=\"1\"} 0\n",
            "gpuplane_test_wait_seconds_bucket{q=\"a\",le=\"60\"} 1\n",
            "gpuplane_test_wait_seconds_bucket{q=\"a\",le=\"+Inf\"} 1\n",
            "gpuplane_test_wait_seconds_sum{q=\"a\"} 42\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
    }
}
