//! `DRAResourceHealth`, v1 and v1alpha1: streams the health of every published device to the
//! kubelet.
//!
//! Both versions are served from one implementation. They are wire-identical apart from the
//! package name; a 1.37 kubelet speaks v1, older ones v1alpha1 (superseded), and the kubelet
//! picks one of them at registration (see `registration.rs`). One stream task produces
//! version-neutral `Report`s and each version only converts them to its own messages.
//!
//! `NodeWatchResources` sends the full list from [`DraDriver::device_health`] at once, again
//! whenever [`DraDriver::health_changes`] ticks and the list differs from the last one sent, and
//! again every [`REFRESH`] regardless: the kubelet stamps each report with its arrival time and
//! turns a device's health to Unknown when it has not heard about it for 30 s (its default
//! health check timeout), so a quiet stream would wrongly age healthy devices into Unknown.
//! Streams end when the server stops (`stopping` turns true), which tonic's graceful shutdown
//! waits for, and when the kubelet hangs up.

use super::{DeviceHealthReport, DeviceHealthState, DraDriver};
use crate::proto::{dra_health_v1 as v1, dra_health_v1alpha1 as v1alpha1};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

/// How often the full list is re-sent when nothing changed; well under the kubelet's 30 s
/// default health timeout.
pub const REFRESH: Duration = Duration::from_secs(10);

/// How long the kubelet should trust a report: a few re-send periods.
const TRUST_SECONDS: i64 = 3 * REFRESH.as_secs() as i64;

/// Serves the device health stream from one driver, in both API versions.
#[derive(Clone)]
pub struct HealthService {
    driver: Arc<dyn DraDriver>,
    /// Turns true when the server stops; open streams then end.
    stopping: watch::Receiver<bool>,
}

/// One device in a report, independent of the API version. Field order makes the derived
/// ordering sort by pool, then device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    pool: String,
    device: String,
    health: Health,
    message: String,
}

/// [`DeviceHealthState`] with an ordering, so that lists compare regardless of driver order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Health {
    Unknown,
    Healthy,
    Unhealthy,
}

impl From<DeviceHealthState> for Health {
    fn from(s: DeviceHealthState) -> Self {
        match s {
            DeviceHealthState::Unknown => Health::Unknown,
            DeviceHealthState::Healthy => Health::Healthy,
            DeviceHealthState::Unhealthy => Health::Unhealthy,
        }
    }
}

/// One message of the stream before it is turned into a version's protobuf.
#[derive(Debug, Clone)]
struct Report {
    devices: Vec<Entry>,
    /// Unix seconds when the list was taken.
    at: i64,
}

/// What a stream compares to decide whether a tick changed anything, sorted so that the
/// driver's ordering does not matter; a device listed twice is sent once.
fn snapshot(reports: Vec<DeviceHealthReport>) -> Vec<Entry> {
    let mut list: Vec<Entry> = reports
        .into_iter()
        .map(|r| Entry {
            pool: r.pool,
            device: r.device,
            health: r.health.into(),
            message: r.message,
        })
        .collect();
    list.sort();
    list.dedup_by(|a, b| a.pool == b.pool && a.device == b.device);
    list
}

fn unix_now() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    i64::try_from(now).unwrap_or(i64::MAX)
}

/// Converts a [`Report`] into one API version's response; the two versions' messages have the
/// same fields, so one body serves both.
macro_rules! to_response {
    ($pb:ident, $report:expr) => {{
        let report: &Report = $report;
        $pb::NodeWatchResourcesResponse {
            devices: report
                .devices
                .iter()
                .map(|e| $pb::DeviceHealth {
                    device: Some($pb::DeviceIdentifier {
                        pool_name: e.pool.clone(),
                        device_name: e.device.clone(),
                    }),
                    health: match e.health {
                        Health::Unknown => $pb::HealthStatus::Unknown,
                        Health::Healthy => $pb::HealthStatus::Healthy,
                        Health::Unhealthy => $pb::HealthStatus::Unhealthy,
                    } as i32,
                    last_updated_time: report.at,
                    health_check_timeout_seconds: TRUST_SECONDS,
                    message: e.message.clone(),
                })
                .collect(),
        }
    }};
}

/// `v1.DRAResourceHealth`'s response for a report.
fn v1_response(report: &Report) -> v1::NodeWatchResourcesResponse {
    to_response!(v1, report)
}

/// `v1alpha1.DRAResourceHealth`'s response for a report.
fn v1alpha1_response(report: &Report) -> v1alpha1::NodeWatchResourcesResponse {
    to_response!(v1alpha1, report)
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl HealthService {
    pub fn new(driver: Arc<dyn DraDriver>, stopping: watch::Receiver<bool>) -> Self {
        HealthService { driver, stopping }
    }

    /// The gRPC server for `v1.DRAResourceHealth`.
    pub fn v1_server(&self) -> v1::dra_resource_health_server::DraResourceHealthServer<Self> {
        v1::dra_resource_health_server::DraResourceHealthServer::new(self.clone())
    }

    /// The gRPC server for `v1alpha1.DRAResourceHealth`.
    pub fn v1alpha1_server(
        &self,
    ) -> v1alpha1::dra_resource_health_server::DraResourceHealthServer<Self> {
        v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(self.clone())
    }

    /// Starts one stream's task; it ends when the receiver is dropped (the kubelet hung up) or
    /// the server stops.
    fn reports(&self) -> mpsc::Receiver<Report> {
        let (tx, rx) = mpsc::channel(4);
        let driver = self.driver.clone();
        let mut changes = driver.health_changes();
        let mut stopping = self.stopping.clone();
        tokio::spawn(async move {
            let mut refresh =
                tokio::time::interval_at(tokio::time::Instant::now() + REFRESH, REFRESH);
            refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut changes_open = true;
            let mut last: Option<Vec<Entry>> = None;
            let mut force = true;
            loop {
                let now = snapshot(driver.device_health());
                if force || last.as_ref() != Some(&now) {
                    let report = Report {
                        devices: now.clone(),
                        at: unix_now(),
                    };
                    tokio::select! {
                        sent = tx.send(report) => if sent.is_err() { return },
                        _ = stopping.wait_for(|s| *s) => return,
                    }
                    last = Some(now);
                }
                force = false;
                tokio::select! {
                    changed = changes.changed(), if changes_open => {
                        if changed.is_err() {
                            // The driver dropped its sender: no more ticks, keep refreshing.
                            changes_open = false;
                        }
                    }
                    _ = refresh.tick() => force = true,
                    _ = tx.closed() => return,
                    _ = stopping.wait_for(|s| *s) => return,
                }
            }
        });
        rx
    }
}

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ResponseStream<v1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let stream = tokio_stream::wrappers::ReceiverStream::new(self.reports())
            .map(|r| Ok(v1_response(&r)));
        Ok(Response::new(Box::pin(stream)))
    }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ResponseStream<v1alpha1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let stream = tokio_stream::wrappers::ReceiverStream::new(self.reports())
            .map(|r| Ok(v1alpha1_response(&r)));
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn report(pool: &str, device: &str, health: DeviceHealthState) -> DeviceHealthReport {
        DeviceHealthReport {
            pool: pool.into(),
            device: device.into(),
            health,
            message: if health == DeviceHealthState::Unhealthy {
                "critical Xid 79".into()
            } else {
                String::new()
            },
        }
    }

    #[test]
    fn snapshot_sorts_and_drops_duplicates() {
        let list = snapshot(vec![
            report("node-a", "gpu-1", DeviceHealthState::Unhealthy),
            report("node-a", "gpu-0", DeviceHealthState::Healthy),
            report("node-a", "gpu-1", DeviceHealthState::Healthy),
        ]);
        let names: Vec<_> = list.iter().map(|e| e.device.as_str()).collect();
        assert_eq!(names, ["gpu-0", "gpu-1"]);
    }

    #[test]
    fn both_versions_encode_the_same_bytes() {
        let r = Report {
            devices: snapshot(vec![
                report("node-a", "gpu-0", DeviceHealthState::Healthy),
                report("node-a", "gpu-1", DeviceHealthState::Unhealthy),
                report("node-a", "gpu-2", DeviceHealthState::Unknown),
            ]),
            at: 1_800_000_000,
        };
        let a = v1_response(&r).encode_to_vec();
        let b = v1alpha1_response(&r).encode_to_vec();
        assert!(!a.is_empty());
        assert_eq!(a, b);
        let decoded = v1::NodeWatchResourcesResponse::decode(a.as_slice()).unwrap();
        assert_eq!(
            decoded.devices[1].health,
            v1::HealthStatus::Unhealthy as i32
        );
        assert_eq!(decoded.devices[1].message, "critical Xid 79");
        assert_eq!(decoded.devices[2].health, v1::HealthStatus::Unknown as i32);
        assert_eq!(
            decoded.devices[0].health_check_timeout_seconds,
            TRUST_SECONDS
        );
    }
}
