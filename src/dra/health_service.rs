//! `v1alpha1.DRAResourceHealth`: streams the health of every published device to the kubelet.
//!
//! `NodeWatchResources` sends the full list from [`DraDriver::device_health`] at once, again
//! whenever [`DraDriver::health_changes`] ticks and the list differs from the last one sent, and
//! again every [`REFRESH`] regardless: the kubelet stamps each report with its arrival time and
//! turns a device's health to Unknown when it has not heard about it for 30 s (its default
//! health check timeout), so a quiet stream would wrongly age healthy devices into Unknown.
//! Streams end when the server stops (`stopping` turns true), which tonic's graceful shutdown
//! waits for, and when the kubelet hangs up.

use super::{DeviceHealthReport, DeviceHealthState, DraDriver};
use crate::proto::dra_health_v1alpha1 as pb;
use pb::dra_resource_health_server::{DraResourceHealth, DraResourceHealthServer};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// How often the full list is re-sent when nothing changed; well under the kubelet's 30 s
/// default health timeout.
pub const REFRESH: Duration = Duration::from_secs(10);

/// Serves the device health stream from one driver.
#[derive(Clone)]
pub struct HealthService {
    driver: Arc<dyn DraDriver>,
    /// Turns true when the server stops; open streams then end.
    stopping: watch::Receiver<bool>,
}

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<pb::NodeWatchResourcesResponse, Status>> + Send>>;

/// The protobuf health value of a device state.
pub fn health_status(state: DeviceHealthState) -> pb::HealthStatus {
    match state {
        DeviceHealthState::Unknown => pb::HealthStatus::Unknown,
        DeviceHealthState::Healthy => pb::HealthStatus::Healthy,
        DeviceHealthState::Unhealthy => pb::HealthStatus::Unhealthy,
    }
}

/// What a stream compares to decide whether a tick changed anything: (pool, device, health,
/// reason), sorted so that the driver's ordering does not matter.
fn snapshot(reports: Vec<DeviceHealthReport>) -> Vec<(String, String, pb::HealthStatus, String)> {
    let mut list: Vec<_> = reports
        .into_iter()
        .map(|r| (r.pool, r.device, health_status(r.health), r.message))
        .collect();
    list.sort();
    list.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
    list
}

/// How long the kubelet should trust a report: a few re-send periods.
const TRUST_SECONDS: i64 = 3 * REFRESH.as_secs() as i64;

fn message(list: &[(String, String, pb::HealthStatus, String)]) -> pb::NodeWatchResourcesResponse {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let now = i64::try_from(now).unwrap_or(i64::MAX);
    pb::NodeWatchResourcesResponse {
        devices: list
            .iter()
            .map(|(pool, device, health, reason)| pb::DeviceHealth {
                device: Some(pb::DeviceIdentifier {
                    pool_name: pool.clone(),
                    device_name: device.clone(),
                }),
                health: *health as i32,
                last_updated_time: now,
                health_check_timeout_seconds: TRUST_SECONDS,
                message: reason.clone(),
            })
            .collect(),
    }
}

impl HealthService {
    pub fn new(driver: Arc<dyn DraDriver>, stopping: watch::Receiver<bool>) -> Self {
        HealthService { driver, stopping }
    }

    /// The gRPC server for this service.
    pub fn server(&self) -> DraResourceHealthServer<HealthService> {
        DraResourceHealthServer::new(self.clone())
    }
}

#[tonic::async_trait]
impl DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<pb::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let driver = self.driver.clone();
        let mut changes = driver.health_changes();
        let mut stopping = self.stopping.clone();
        tokio::spawn(async move {
            let mut refresh =
                tokio::time::interval_at(tokio::time::Instant::now() + REFRESH, REFRESH);
            refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut changes_open = true;
            let mut last: Option<Vec<(String, String, pb::HealthStatus, String)>> = None;
            let mut force = true;
            loop {
                let now = snapshot(driver.device_health());
                if force || last.as_ref() != Some(&now) {
                    let msg = message(&now);
                    tokio::select! {
                        sent = tx.send(Ok(msg)) => if sent.is_err() { return },
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
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}
