//! DRA, the pure half: the plain types the kubelet's DRA calls carry ([`ClaimRef`], checked
//! once where it arrives ([`identity`]), [`PreparedDevice`], health reports), claim planning
//! ([`claims`]), our opaque device config ([`opaque`]) and the claim `status.devices` entries
//! ([`status`]). The gRPC shell and the
//! core that does the I/O are the product's `dra`.

pub mod claims;
pub mod identity;
pub mod opaque;
pub mod status;

pub use identity::{ClaimUid, IdentityError, ObjectName};

/// A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources, each part
/// already checked ([`ClaimRef::parse`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimRef {
    pub namespace: ObjectName,
    pub uid: ClaimUid,
    pub name: ObjectName,
}

impl ClaimRef {
    /// Checks the kubelet's strings: the UID first, then the namespace, then the name.
    pub fn parse(
        namespace: impl Into<String>,
        uid: impl Into<String>,
        name: impl Into<String>,
    ) -> Result<ClaimRef, IdentityError> {
        let uid = ClaimUid::parse(uid)?;
        Ok(ClaimRef {
            namespace: ObjectName::parse("namespace", namespace)?,
            uid,
            name: ObjectName::parse("name", name)?,
        })
    }
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

/// Per-claim answer as the kubelet receives it: the prepared devices, or the error message it
/// shows and retries on. The driver's answers are typed; the gRPC edge makes this.
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
