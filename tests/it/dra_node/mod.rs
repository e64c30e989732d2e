//! The DRA driver end to end (see tests/support/lab.rs for the set-up), and the allocation
//! ledger across both kubelet APIs.

use crate::lab::{Lab, DRIVER, NODE, WAIT};
use crate::support;
use gpuplane_model::source::DeviceSource;
use gpuplane_node::dra::ClaimRef;
use gpuplane_node::proto::dra_health_v1::HealthStatus;
use gpuplane_testkit::doubles::apiserver::Fault;
use gpuplane_testkit::doubles::kubelet::PluginView;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

mod claims_and_slices;
mod health;
mod hung_probes;
mod ledger;
mod node_labels;

/// An address for an agent's `/metrics`, `/healthz` and `/readyz`.
fn metrics_addr() -> std::net::SocketAddr {
    ([127, 0, 0, 1], support::free_port()).into()
}

/// Waits until the agent serving on `addr` says it is ready.
async fn wait_ready(addr: std::net::SocketAddr) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (code, body) = tokio::task::spawn_blocking(move || {
            support::http_get(addr, "/readyz").unwrap_or_default()
        })
        .await
        .unwrap();
        if code == 200 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent never turned ready: {code} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
