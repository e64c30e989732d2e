//! The node agent's metric families (process-wide registry) and per-agent counters, over
//! the shared registry helpers of `gpuplane_common::metrics`, re-exported here so the agent's
//! code names one `metrics` module.

pub use gpuplane_common::metrics::*;

use gpuplane_common::label_values;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::OnceLock;

label_values! {
    /// The kubelet API a unit went through.
    pub enum Api {
        DevicePlugin => "device-plugin",
        Dra => "dra",
    }
}

label_values! {
    /// How a device plugin Allocate ended.
    pub enum Allocation {
        Granted => "granted",
        Refused => "refused",
    }
}

label_values! {
    /// How preparing one claim ended.
    pub enum Prepare {
        Prepared => "prepared",
        Failed => "failed",
    }
}

label_values! {
    /// How a ResourceSlice sync ended.
    pub enum SliceSync {
        Ok => "ok",
        Failed => "failed",
    }
}

label_values! {
    /// A ResourceSlice write.
    pub enum SliceOp {
        Create => "create",
        Update => "update",
        Delete => "delete",
    }
}

label_values! {
    /// What became of a config file read again (after SIGHUP or a change of the file).
    pub enum ConfigReload {
        Applied => "applied",
        Refused => "refused",
    }
}

label_values! {
    /// What became of an Event on a ResourceClaim.
    pub enum ClaimEvent {
        Posted => "posted",
        Deduplicated => "deduplicated",
        Failed => "failed",
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct ApiLabel {
    pub api: Api,
}

impl ApiLabel {
    pub const DEVICE_PLUGIN: ApiLabel = ApiLabel {
        api: Api::DevicePlugin,
    };
    pub const DRA: ApiLabel = ApiLabel { api: Api::Dra };
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct AllocationLabels {
    pub resource: String,
    pub outcome: Allocation,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct PrepareLabel {
    pub outcome: Prepare,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct XidLabel {
    pub xid: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct SliceSyncLabel {
    pub outcome: SliceSync,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct SliceOpLabel {
    pub op: SliceOp,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct ConfigReloadLabel {
    pub outcome: ConfigReload,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct ClaimEventLabel {
    pub outcome: ClaimEvent,
}

/// The node agent's counters kept per agent (its `NodeState` holds them) instead of in the
/// process-wide registry: the code that counts holds the state anyway (the state owner, the
/// DRA shell), and agents sharing one process (tests, the demo) each show their own, so a test
/// can wait for "the reload was refused" on one agent's `/metrics`. Every series exists from
/// the start, at 0. Clones share their values; `/metrics` registers clones into the registry
/// it makes for each scrape.
#[derive(Debug, Clone)]
pub struct AgentCounters {
    /// `gpuplane_config_reloads_total{outcome}`: config file reads applied (also when equal
    /// to the running config) or refused (unreadable, invalid, or not offerable; the running
    /// config stays).
    pub config_reloads: Family<ConfigReloadLabel, Counter>,
    /// `gpuplane_claim_events_total{outcome}`: Events on ResourceClaims posted, not posted
    /// again because the same one was posted lately, or whose write failed.
    pub claim_events: Family<ClaimEventLabel, Counter>,
}

impl Default for AgentCounters {
    fn default() -> Self {
        let counters = AgentCounters {
            config_reloads: Family::default(),
            claim_events: Family::default(),
        };
        // A series is created by its first look-up, at 0.
        for outcome in [ConfigReload::Applied, ConfigReload::Refused] {
            let _ = counters
                .config_reloads
                .get_or_create(&ConfigReloadLabel { outcome });
        }
        for outcome in [
            ClaimEvent::Posted,
            ClaimEvent::Deduplicated,
            ClaimEvent::Failed,
        ] {
            let _ = counters
                .claim_events
                .get_or_create(&ClaimEventLabel { outcome });
        }
        counters
    }
}

impl AgentCounters {
    pub fn config_reload(&self, outcome: ConfigReload) {
        self.config_reloads
            .get_or_create(&ConfigReloadLabel { outcome })
            .inc();
    }

    pub fn claim_event(&self, outcome: ClaimEvent) {
        self.claim_events
            .get_or_create(&ClaimEventLabel { outcome })
            .inc();
    }

    /// Registers clones of the families into `r` (the registry made for one scrape).
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "gpuplane_config_reloads",
            "Config file reads by outcome (applied; refused: the running config stays)",
            self.config_reloads.clone(),
        );
        r.register(
            "gpuplane_claim_events",
            "Events on ResourceClaims by outcome (posted, deduplicated: posted lately already, failed)",
            self.claim_events.clone(),
        );
    }
}

/// The node agent's counters and histograms (its scrape-time gauges are in `node/http.rs`).
#[derive(Debug)]
pub struct Node {
    /// `gpuplane_ledger_handouts_total{api}`
    pub ledger_handouts: Family<ApiLabel, Counter>,
    /// `gpuplane_ledger_releases_total{api}`
    pub ledger_releases: Family<ApiLabel, Counter>,
    /// `gpuplane_ledger_refusals_total{api}`
    pub ledger_refusals: Family<ApiLabel, Counter>,
    /// `gpuplane_allocations_total{resource,outcome}`
    pub allocations: Family<AllocationLabels, Counter>,
    /// `gpuplane_allocate_seconds`
    pub allocate_seconds: Histogram,
    /// `gpuplane_prepares_total{outcome}`
    pub prepares: Family<PrepareLabel, Counter>,
    /// `gpuplane_prepare_seconds`
    pub prepare_seconds: Histogram,
    /// `gpuplane_discovery_failures_total`: NVML not loadable yet, a query every GPU needs failing.
    pub discovery_failures: Counter,
    /// `gpuplane_xid_events_total{xid}`
    pub xid_events: Family<XidLabel, Counter>,
    /// `gpuplane_slice_syncs_total{outcome}`: a failing API server shows as a growing `failed`.
    pub slice_syncs: Family<SliceSyncLabel, Counter>,
    /// `gpuplane_slice_writes_total{op}`: on a quiet node this stays flat.
    pub slice_writes: Family<SliceOpLabel, Counter>,
}

impl Node {
    fn register(r: &mut Registry) -> Node {
        Node {
            ledger_handouts: register(
                r,
                "gpuplane_ledger_handouts",
                "Devices handed out through the allocation ledger, by API",
                Family::default(),
            ),
            ledger_releases: register(
                r,
                "gpuplane_ledger_releases",
                "Devices released in the allocation ledger, by API",
                Family::default(),
            ),
            ledger_refusals: register(
                r,
                "gpuplane_ledger_refusals",
                "Requests refused because another consumer held a device, by API",
                Family::default(),
            ),
            allocations: register(
                r,
                "gpuplane_allocations",
                "Device plugin Allocate calls by resource and outcome",
                Family::default(),
            ),
            allocate_seconds: register(
                r,
                "gpuplane_allocate_seconds",
                "Device plugin Allocate latency",
                latency(),
            ),
            prepares: register(
                r,
                "gpuplane_prepares",
                "NodePrepareResources claims by outcome",
                Family::default(),
            ),
            prepare_seconds: register(
                r,
                "gpuplane_prepare_seconds",
                "Time to prepare one claim",
                latency(),
            ),
            discovery_failures: register(
                r,
                "gpuplane_discovery_failures",
                "Start-up device discovery attempts that failed (each is retried with backoff)",
                Counter::default(),
            ),
            xid_events: register(
                r,
                "gpuplane_xid_events",
                "Xid events reported by the driver, by code",
                Family::default(),
            ),
            slice_syncs: register(
                r,
                "gpuplane_slice_syncs",
                "ResourceSlice syncs by outcome (ok, failed: retried after a pause)",
                Family::default(),
            ),
            slice_writes: register(
                r,
                "gpuplane_slice_writes",
                "ResourceSlice writes to the API server, by operation",
                Family::default(),
            ),
        }
    }
}

struct Global {
    registry: Registry,
    node: Node,
}

fn global() -> &'static Global {
    static G: OnceLock<Global> = OnceLock::new();
    G.get_or_init(|| {
        let mut registry = Registry::default();
        let node = Node::register(&mut registry);
        Global { registry, node }
    })
}

/// The node agent's families.
pub fn node() -> &'static Node {
    &global().node
}

/// The process-wide registry (the node agent's families).
pub fn registry() -> &'static Registry {
    &global().registry
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::collector::Collector;
    use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};

    fn node_metrics() -> (Registry, Node) {
        let mut r = Registry::default();
        let node = Node::register(&mut r);
        (r, node)
    }

    fn assert_lines(text: &str, lines: &[&str]) {
        for line in lines {
            assert!(
                text.lines().any(|l| l == *line),
                "{line:?} missing from:\n{text}"
            );
        }
    }

    #[test]
    fn counters_and_histograms_render_as_openmetrics_under_their_names() {
        let (r, m) = node_metrics();
        let prepared = PrepareLabel {
            outcome: Prepare::Prepared,
        };
        m.prepares.get_or_create(&prepared).inc();
        m.prepares.get_or_create(&prepared).inc();
        m.prepare_seconds.observe(0.003);
        m.allocations
            .get_or_create(&AllocationLabels {
                resource: "nvidia.com/gpu".into(),
                outcome: Allocation::Granted,
            })
            .inc();
        m.ledger_handouts
            .get_or_create(&ApiLabel {
                api: Api::DevicePlugin,
            })
            .inc();
        m.ledger_refusals.get_or_create(&ApiLabel::DRA).inc();
        m.ledger_releases.get_or_create(&ApiLabel::DRA).inc();
        m.xid_events.get_or_create(&XidLabel { xid: 79 }).inc();
        m.slice_syncs
            .get_or_create(&SliceSyncLabel {
                outcome: SliceSync::Failed,
            })
            .inc();
        m.slice_writes
            .get_or_create(&SliceOpLabel {
                op: SliceOp::Create,
            })
            .inc_by(3);
        let text = render(&[&r]);
        assert_lines(
            &text,
            &[
                "# HELP gpuplane_prepares NodePrepareResources claims by outcome.",
                "# TYPE gpuplane_prepares counter",
                "gpuplane_prepares_total{outcome=\"prepared\"} 2",
                "# TYPE gpuplane_prepare_seconds histogram",
                "gpuplane_prepare_seconds_bucket{le=\"0.001\"} 0",
                "gpuplane_prepare_seconds_bucket{le=\"0.005\"} 1",
                "gpuplane_prepare_seconds_bucket{le=\"5.0\"} 1",
                "gpuplane_prepare_seconds_bucket{le=\"+Inf\"} 1",
                "gpuplane_prepare_seconds_count 1",
                "gpuplane_prepare_seconds_sum 0.003",
                "gpuplane_allocations_total{resource=\"nvidia.com/gpu\",outcome=\"granted\"} 1",
                "gpuplane_ledger_handouts_total{api=\"device-plugin\"} 1",
                "gpuplane_ledger_refusals_total{api=\"dra\"} 1",
                "gpuplane_ledger_releases_total{api=\"dra\"} 1",
                "gpuplane_xid_events_total{xid=\"79\"} 1",
                "gpuplane_slice_syncs_total{outcome=\"failed\"} 1",
                "gpuplane_slice_writes_total{op=\"create\"} 3",
                "gpuplane_discovery_failures_total 0",
                "gpuplane_allocate_seconds_count 0",
            ],
        );
        assert!(text.ends_with("\n# EOF\n"), "{text}");
        assert!(!text.contains("_total_total"), "{text}");
    }

    #[test]
    fn agent_counters_render_every_outcome_from_zero_and_keep_apart_per_agent() {
        let (a, b) = (AgentCounters::default(), AgentCounters::default());
        a.config_reload(ConfigReload::Refused);
        a.clone().claim_event(ClaimEvent::Deduplicated);
        b.config_reload(ConfigReload::Applied);
        let mut r = Registry::default();
        a.register(&mut r);
        let text = render(&[&r]);
        assert_lines(
            &text,
            &[
                "# TYPE gpuplane_config_reloads counter",
                "gpuplane_config_reloads_total{outcome=\"applied\"} 0",
                "gpuplane_config_reloads_total{outcome=\"refused\"} 1",
                "gpuplane_claim_events_total{outcome=\"posted\"} 0",
                "gpuplane_claim_events_total{outcome=\"deduplicated\"} 1",
                "gpuplane_claim_events_total{outcome=\"failed\"} 0",
            ],
        );
    }

    #[derive(Debug)]
    struct Scraped;

    #[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
    struct ResourceLabel {
        resource: String,
    }

    impl Collector for Scraped {
        fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
            let series = [
                (
                    ResourceLabel {
                        resource: "a\"b".into(),
                    },
                    0.5,
                ),
                (
                    ResourceLabel {
                        resource: "c".into(),
                    },
                    2.0,
                ),
            ];
            gauges(&mut e, "gpuplane_test_share", "Shares.", &series)?;
            gauge(&mut e, "gpuplane_test_up", "Up.", 1i64)?;
            counter(&mut e, "gpuplane_test_writes", "Writes.", 7)
        }
    }

    #[test]
    fn scrape_time_values_render_after_the_registries_before_them() {
        let (node, _m) = node_metrics();
        let mut scrape = Registry::default();
        scrape.register_collector(Box::new(Scraped));
        let text = render(&[&node, &scrape]);
        assert_lines(
            &text,
            &[
                "# HELP gpuplane_test_share Shares.",
                "# TYPE gpuplane_test_share gauge",
                "gpuplane_test_share{resource=\"a\\\"b\"} 0.5",
                "gpuplane_test_share{resource=\"c\"} 2.0",
                "gpuplane_test_up 1",
                "# TYPE gpuplane_test_writes counter",
                "gpuplane_test_writes_total 7",
            ],
        );
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        // A family shows once it has a series: a histogram or a counter without labels at
        // once, a family by label set after its first count.
        let histogram = text.find("# TYPE gpuplane_prepare_seconds histogram");
        assert!(histogram.is_some(), "{text}");
        assert!(histogram < text.find("gpuplane_test_up"), "{text}");
        assert!(!text.contains("gpuplane_prepares"), "{text}");
    }
}
