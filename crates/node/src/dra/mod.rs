//! The DRA kubelet plugin (resource.k8s.io/v1, kubelet DRA v1 and v1beta1).
//!
//! `DraDriver` is the seam between the gRPC shell (services, plugin registration, health
//! stream) and the core that prepares claims (claim lookup, opaque config, checkpoint, CDI).
//! The shell converts protobuf to these plain types and back; the core never sees tonic.

pub mod checkpoint;
pub mod core;
pub mod fetch;
pub mod health_service;
pub mod registration;
pub mod server;
pub mod service;

pub use gpuplane_model::dra::*;

use std::collections::BTreeMap;
use tokio::sync::watch;

/// What the gRPC shell needs from the DRA core.
#[async_trait::async_trait]
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
