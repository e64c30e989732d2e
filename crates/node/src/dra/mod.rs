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

use self::core::{PrepareError, UnprepareError, UserEvent};
use std::collections::BTreeMap;
use tokio::sync::watch;

/// What the gRPC shell needs from the DRA core. Answers are keyed by claim UID and typed; the
/// gRPC service ([`service`]) alone turns an error into the kubelet's string
/// ([`service::kubelet_error`]).
#[async_trait::async_trait]
pub trait DraDriver: Send + Sync + 'static {
    /// Prepares each claim independently; every claim UID gets an entry.
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<ClaimUid, Result<Vec<PreparedDevice>, PrepareError>>;
    /// Unprepares each claim; unknown claims succeed. Every claim UID gets an entry.
    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<ClaimUid, Result<(), UnprepareError>>;
    /// Every published device with its health now.
    fn device_health(&self) -> Vec<DeviceHealthReport>;
    /// Wakes on every health or inventory change.
    fn health_changes(&self) -> watch::Receiver<u64>;
    /// The Event the user of a prepared claim must see although the prepare succeeded (a share
    /// whose limits are not enforced). Asked separately rather than returned with every
    /// prepare, so the answer stays what the kubelet gets and only the Event poster
    /// ([`crate::node::events::ReportingDriver`]) asks; a driver without shares has none.
    async fn share_notice(&self, _uid: &ClaimUid) -> Option<UserEvent> {
        None
    }
}
