//! The DRA kubelet plugin (resource.k8s.io/v1, kubelet DRA v1 and v1beta1).
//!
//! `DraDriver` is the seam between the gRPC shell (services, plugin registration, health
//! stream) and the core that prepares claims (claim lookup, opaque config, checkpoint, CDI).
//! The shell converts protobuf to these plain types and back; the core never sees tonic.

pub mod checkpoint;
pub mod claims;
pub mod core;
pub mod health_service;
pub mod opaque;
pub mod registration;
pub mod server;
pub mod service;
pub mod status;

use std::collections::BTreeMap;
use tokio::sync::watch;

/// A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimRef {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

/// One device prepared for a claim, as returned to the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The claim's request names this device satisfies.
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    /// Fully qualified CDI device ids to inject.
    pub cdi_ids: Vec<String>,
    /// Set for devices allocated with a share id (consumable capacity); v1 only.
    #[serde(default)]
    pub share_id: Option<String>,
}

/// Per-claim answer: the prepared devices, or an error message the kubelet shows and retries.
pub type PrepareResult = Result<Vec<PreparedDevice>, String>;

/// Health of one published device, for the DRA health stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealthReport {
    pub pool: String,
    pub device: String,
    pub health: DeviceHealthState,
    /// Why, e.g. `critical Xid 48`; empty when healthy.
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceHealthState {
    Unknown,
    Healthy,
    Unhealthy,
}

/// What the gRPC shell needs from the DRA core.
#[tonic::async_trait]
pub trait DraDriver: Send + Sync + 'static {
    /// Prepares each claim independently; every claim UID gets an entry.
    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult>;
    /// Unprepares each claim; unknown claims succeed. Every claim UID gets an entry.
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>>;
    /// Every published device with its health now.
    fn device_health(&self) -> Vec<DeviceHealthReport>;
    /// Wakes on every health or inventory change.
    fn health_changes(&self) -> watch::Receiver<u64>;
}
