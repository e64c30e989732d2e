//! The agent's HTTP endpoints: `/metrics` (OpenMetrics text), `/healthz` (the state owner is
//! turning) and `/readyz` (devices discovered, registered with the kubelet for every enabled API,
//! and the node's ResourceSlices published when DRA is on). They are served from the start,
//! before the devices are discovered.

use crate::health::Health;
use crate::httpserve::{serve as serve_http, ServeLimits};
use crate::metrics::{self, ApiLabel};
use crate::state::NodeState;
use crate::telemetry::export::TelemetryGauges;
use crate::telemetry::Telemetry;
use gpuplane_common::label_values;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The state owner is considered stuck after this long without a tick.
pub const STUCK_AFTER: Duration = Duration::from_secs(10);

/// What `/healthz` and `/readyz` report, updated by the agent's tasks.
#[derive(Debug, Default)]
pub struct Readiness {
    /// Unix milliseconds of the state owner's last tick.
    pub last_tick_ms: AtomicU64,
    /// `None`: the device plugin is off; else whether every resource is registered.
    pub device_plugin: Option<Arc<AtomicBool>>,
    /// `None`: DRA is off; else, once DRA started, its registration and publication.
    pub dra: Option<OnceLock<DraReadiness>>,
    /// Why the devices are not discovered yet; `None` once they are. A watch, not a mutex:
    /// async code must not take std locks (tests/it/security.rs).
    pub discovery: watch::Sender<Option<String>>,
}

/// What DRA readiness follows.
#[derive(Debug)]
pub struct DraReadiness {
    /// Whether the kubelet confirmed the DRA plugin's registration.
    pub registered: watch::Receiver<bool>,
    /// Whether the node's ResourceSlices are published as wanted.
    pub published: watch::Receiver<bool>,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Readiness {
    pub fn tick(&self) {
        self.last_tick_ms.store(now_ms(), Ordering::Relaxed);
    }

    fn live(&self) -> Result<(), String> {
        let age = now_ms().saturating_sub(self.last_tick_ms.load(Ordering::Relaxed));
        if age > u64::try_from(STUCK_AFTER.as_millis()).unwrap_or(u64::MAX) {
            return Err(format!("the state owner has not turned for {age} ms"));
        }
        Ok(())
    }

    fn ready(&self) -> Result<(), String> {
        self.live()?;
        if let Some(why) = self.discovery.borrow().as_ref() {
            return Err(format!("devices not discovered yet: {why}"));
        }
        if let Some(dp) = &self.device_plugin {
            if !dp.load(Ordering::Relaxed) {
                return Err(
                    "device plugin: not every resource is registered with the kubelet".into(),
                );
            }
        }
        if let Some(dra) = &self.dra {
            let Some(dra) = dra.get() else {
                return Err("DRA: not started yet".into());
            };
            if !*dra.registered.borrow() {
                return Err("DRA: the kubelet has not confirmed the plugin registration".into());
            }
            if !*dra.published.borrow() {
                return Err(
                    "DRA: ResourceSlices not published yet or the last sync failed (see the log)"
                        .into(),
                );
            }
        }
        Ok(())
    }
}

label_values! {
    /// Whether a device is offered as healthy.
    enum HealthLabel {
        Healthy => "healthy",
        Unhealthy => "unhealthy",
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DeviceLabels {
    resource: String,
    health: HealthLabel,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct GpuLabel {
    gpu: u32,
}

/// The gauges derived from the state at a scrape.
#[derive(Debug)]
struct StateGauges {
    devices: Vec<(DeviceLabels, i64)>,
    held: [(ApiLabel, i64); 2],
    /// Per dynamic-MIG GPU, the instances it has now (all gpuplane's: a GPU with another
    /// tool's instances does not take part).
    mig_instances: Vec<(GpuLabel, i64)>,
}

impl StateGauges {
    fn read(state: &NodeState) -> StateGauges {
        let snap = state.read();
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let mut devices = Vec::new();
        for r in &snap.plan.resources {
            let unhealthy = r
                .devices
                .iter()
                .filter(|d| matches!(snap.health.health(&d.unit), Health::Unhealthy(_)))
                .count();
            for (health, n) in [
                (HealthLabel::Healthy, r.devices.len() - unhealthy),
                (HealthLabel::Unhealthy, unhealthy),
            ] {
                let resource = r.name.to_string();
                devices.push((DeviceLabels { resource, health }, count(n)));
            }
        }
        let mut held = snap.ledger.holds().fold([0usize; 2], |mut acc, (_, h)| {
            acc[usize::from(matches!(h, crate::ledger::Holder::Claim { .. }))] += 1;
            acc
        });
        // A shared unit with any share held counts once: it is held for everyone else.
        held[1] += snap.ledger.shares().count();
        let mig_instances = snap
            .inventory
            .gpus
            .iter()
            .filter(|g| g.mig.dynamic)
            .map(|g| (GpuLabel { gpu: g.index }, count(g.mig_devices.len())))
            .collect();
        StateGauges {
            mig_instances,
            devices,
            held: [
                (ApiLabel::DEVICE_PLUGIN, count(held[0])),
                (ApiLabel::DRA, count(held[1])),
            ],
        }
    }
}

impl Collector for StateGauges {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        metrics::gauges(
            &mut e,
            "gpuplane_devices",
            "Devices offered through the device plugin API, by resource and health.",
            &self.devices,
        )?;
        metrics::gauges(
            &mut e,
            "gpuplane_ledger_held_units",
            "Units (GPUs or MIG devices) held in the allocation ledger, by API; a shared unit with shares held counts once.",
            &self.held,
        )?;
        metrics::gauges(
            &mut e,
            "gpuplane_dynamic_mig_instances",
            "MIG instances gpuplane created for prepared claims, per GPU taking part in dynamic MIG.",
            &self.mig_instances,
        )
    }
}

/// The process-wide families, the agent's own counters, the gauges of `state` and the
/// devices' telemetry once it runs.
fn exposition(state: &NodeState, telemetry: &OnceLock<Arc<Telemetry>>) -> String {
    let mut scrape = Registry::default();
    state.counters().register(&mut scrape);
    scrape.register_collector(Box::new(StateGauges::read(state)));
    if let Some(t) = telemetry.get() {
        scrape.register_collector(Box::new(TelemetryGauges {
            attributed: t.attributed(state),
            idle: t.idle(),
            busy: t.busy(),
        }));
    }
    metrics::render(&[metrics::registry(), &scrape])
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

fn route(
    path: &str,
    state: &NodeState,
    readiness: &Readiness,
    telemetry: &OnceLock<Arc<Telemetry>>,
) -> Response<Full<Bytes>> {
    let check = |r: Result<(), String>| match r {
        Ok(()) => text(StatusCode::OK, "ok\n".into()),
        Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
    };
    match path {
        "/metrics" => {
            let mut r = text(StatusCode::OK, exposition(state, telemetry));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(metrics::CONTENT_TYPE),
            );
            r
        }
        "/healthz" => check(readiness.live()),
        "/readyz" => check(readiness.ready()),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /metrics, /healthz or /readyz\n".into(),
        ),
    }
}

/// Serves the endpoints on `listener` until `shutdown` turns true.
pub async fn serve(
    listener: TcpListener,
    state: Arc<NodeState>,
    readiness: Arc<Readiness>,
    telemetry: Arc<OnceLock<Arc<Telemetry>>>,
    shutdown: watch::Receiver<bool>,
) {
    let answer = move |_peer, req: Request<hyper::body::Incoming>| {
        let resp = route(req.uri().path(), &state, &readiness, &telemetry);
        async move { resp }
    };
    // Scrapes and probes are few; a small pool keeps a flood from costing the agent memory.
    let limits = ServeLimits {
        max_connections: 64,
        ..ServeLimits::default()
    };
    serve_http("node-metrics", listener, None, limits, answer, shutdown).await;
}

/// Binds the metrics address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
