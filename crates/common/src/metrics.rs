//! Prometheus metrics (`gpuplane_` prefix) on prometheus-client, served as OpenMetrics text:
//! what the node agent's and the cluster side's families share.
//!
//! Each family is defined once, with its name, help and typed label set, by its owner: the
//! node agent's in `gpuplane_node::metrics`, in a process-wide registry like the Prometheus
//! clients' default one; the webhook's and the quota loops' in a registry per instance, so two
//! replicas in one process (tests, the demo) never mix their numbers. Values computed from
//! state when `/metrics` is scraped are
//! [`Collector`](prometheus_client::collector::Collector)s, written with [`gauges`], [`gauge`]
//! and [`counter`], in a registry made for the scrape; [`render`] encodes them all as one
//! exposition.
//!
//! Counters are named without their `_total` suffix (the encoder appends it); a registered
//! family's help has no final full stop (the registry appends it), a collector's has.

use prometheus_client::encoding::{
    text, DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, NoLabelSet,
};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Histogram buckets for call latencies, in seconds.
pub const BUCKETS: &[f64] = &[0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// A histogram with the call-latency [`BUCKETS`].
pub fn latency() -> Histogram {
    Histogram::new(BUCKETS.iter().copied())
}

/// Histograms by label set, each made by a constructor that picks the buckets (e.g. [`latency`]).
pub type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Registers a clone of `metric` (they share their values) and returns `metric`.
pub fn register<M: Metric + Clone>(r: &mut Registry, name: &str, help: &str, metric: M) -> M {
    r.register(name, help, metric.clone());
    metric
}

/// Declares an enum of label values and the text each is exposed as (the derive would expose
/// the variant's name).
#[macro_export]
macro_rules! label_values {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $($variant),+
        }

        impl prometheus_client::encoding::EncodeLabelValue for $name {
            fn encode(
                &self,
                e: &mut prometheus_client::encoding::LabelValueEncoder,
            ) -> std::fmt::Result {
                std::fmt::Write::write_str(e, match self {
                    $($name::$variant => $text),+
                })
            }
        }
    };
}

/// `registries` as one OpenMetrics exposition, ending with `# EOF`.
pub fn render(registries: &[&Registry]) -> String {
    let mut out = String::new();
    let written = registries
        .iter()
        .try_for_each(|r| text::encode_registry(&mut out, r))
        .and_then(|()| text::encode_eof(&mut out));
    if written.is_err() {
        // Writing to a String does not fail; only a collector could, and ours do not.
        tracing::error!("encoding the metrics failed; the exposition is cut short");
    }
    out
}

/// A gauge family computed at scrape time (by a collector), one sample per series.
pub fn gauges<L: EncodeLabelSet, V: EncodeGaugeValue>(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: &[(L, V)],
) -> std::fmt::Result {
    let mut family = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in series {
        family.encode_family(labels)?.encode_gauge(value)?;
    }
    Ok(())
}

/// A counter family kept elsewhere and read at scrape time, one sample per series; `name`
/// without `_total`, which the encoder appends.
pub fn counters<L: EncodeLabelSet>(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: &[(L, f64)],
) -> std::fmt::Result {
    let mut family = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in series {
        family
            .encode_family(labels)?
            .encode_counter::<NoLabelSet, _, u64>(value, None)?;
    }
    Ok(())
}

/// A gauge without labels computed at scrape time.
pub fn gauge<V: EncodeGaugeValue>(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: V,
) -> std::fmt::Result {
    e.encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&value)
}

/// A counter without labels kept elsewhere (a plain atomic) and read at scrape time; `name`
/// without `_total`, which the encoder appends.
pub fn counter(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> std::fmt::Result {
    e.encode_descriptor(name, help, None, MetricType::Counter)?
        .encode_counter::<NoLabelSet, _, u64>(&value, None)
}
