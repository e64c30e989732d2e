//! Why the core could not start, why a claim could not be prepared or unprepared, and what of
//! a failure the claim's user is told. The kubelet's text is made at the gRPC edge
//! ([`crate::dra::service::kubelet_error`]), from these errors' Display.

use crate::cdi::{DeviceNodesError, NameError, WriteError};
use crate::dra::checkpoint::CheckpointError;
use crate::dra::claims::ClaimError;
use crate::dra::fetch::FetchError;
use crate::ledger::{Held, ShareRefused};
use crate::mps::MpsError;
use gpuplane_model::report::{chain, truncate, MAX_NOTE_BYTES};

/// Why the core could not start.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("driver name `{driver}` does not make a CDI vendor `k8s.{driver}`: {}", chain(.cause))]
    Kind { driver: String, cause: NameError },
    #[error("loading the DRA checkpoint: {}", chain(.cause))]
    Checkpoint { cause: CheckpointError },
}

/// Why one claim could not be prepared (the claim is named by the caller).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("{}", chain(.cause))]
    Fetch { cause: Box<FetchError> },
    #[error("{}", chain(.cause))]
    Plan { cause: ClaimError },
    #[error(transparent)]
    MissingDeviceNodes(DeviceNodesError),
    #[error("CDI device name for {device}: {}", chain(.cause))]
    CdiName { device: String, cause: NameError },
    #[error("{}", chain(.cause))]
    Checkpoint { cause: CheckpointError },
    #[error("{}", chain(.cause))]
    Spec { cause: WriteError },
    /// The blocking-pool job that writes the claim's files panicked (a bug).
    #[error("the file-writing job failed: {0}")]
    Worker(String),
    /// Another consumer (a device-plugin container, another claim) holds a device of the claim.
    #[error("device {device}: {}; it cannot be given out twice", chain(.cause))]
    Held { device: String, cause: Box<Held> },
    /// A share does not fit: another consumer holds the unit whole, or the shares already
    /// prepared leave too little (a stale scheduler cache could ask).
    #[error("device {device}: {}", chain(.cause))]
    ShareRefused {
        device: String,
        cause: Box<ShareRefused>,
    },
    /// A dynamic MIG instance could not be created.
    #[error("device {device}: could not {action} its MIG instance: {}", chain(.cause))]
    Mig {
        device: String,
        action: &'static str,
        cause: crate::source::MigChangeError,
    },
    /// The MPS control daemon of a shared unit could not be started.
    #[error("{}", chain(.cause))]
    Mps { cause: MpsError },
    /// The agent (re)started and the kubelet's PodResources has not told it yet which devices
    /// the device plugin API holds; the kubelet retries.
    #[error("the agent does not know yet which devices the device plugin API holds (no PodResources listing within {waited:?} of its start); preparing is retried")]
    HoldsUnknown { waited: std::time::Duration },
}

/// What a user must see of a failed prepare: an Event on the ResourceClaim with a reason
/// (PascalCase, for `kubectl get events --field-selector reason=...`) and a note naming what to
/// do. The kubelet's `FailedPrepareDynamicResources` on the pod carries the error text, but not
/// on the claim (which a shared claim's owner watches) and not what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserEvent {
    pub reason: &'static str,
    pub note: String,
}

impl PrepareError {
    /// The Event a user must see for this failure; None for failures the kubelet's retry
    /// resolves or only the node's operator can act on (those are logged).
    pub fn user_event(&self) -> Option<UserEvent> {
        let (reason, advice) = match self {
            PrepareError::ShareRefused { .. } => (
                "ShareDoesNotFit",
                "the device's capacity is taken by the holders named; delete this claim's pod \
                 so the scheduler allocates again, or wait until a holder ends",
            ),
            PrepareError::Mps { .. } => (
                "MPSDaemonFailed",
                "the node's MPS control daemon for the GPU did not start; the kubelet retries, \
                 and the node's operator finds the cause in the daemon's log named here",
            ),
            PrepareError::Mig {
                cause: crate::source::MigChangeError::Refused(_),
                ..
            } => (
                "MIGPlacementRefused",
                "the GPU refused the MIG instance the scheduler placed there (an instance \
                 gpuplane did not create, or a stale allocation); delete this claim's pod so the \
                 scheduler allocates again, and see the node agent's log for the GPU's instances",
            ),
            PrepareError::Held { .. } => (
                "DeviceInUse",
                "another consumer (a device-plugin container or another claim) holds it; \
                 delete this claim's pod so the scheduler allocates another device, or wait \
                 until the holder ends",
            ),
            PrepareError::Plan { cause } => plan_event(cause)?,
            PrepareError::MissingDeviceNodes(_) => (
                "DeviceNodesMissing",
                "the NVIDIA driver has not created its device nodes (or something else is in \
                 their place) on this node; preparing is retried, and if this persists the \
                 node's driver installation needs a look",
            ),
            _ => return None,
        };
        Some(UserEvent {
            reason,
            note: truncate(format!("{self}: {advice}."), MAX_NOTE_BYTES),
        })
    }
}

/// The reason and advice of a claim the plan refused, when its user can act on it.
fn plan_event(cause: &ClaimError) -> Option<(&'static str, &'static str)> {
    Some(match cause {
        ClaimError::Unhealthy { .. } => (
            "DeviceUnhealthy",
            "delete this claim's pod (and the claim, if it is not from a template) so the \
             scheduler allocates a healthy device; the device carries a health taint in its \
             ResourceSlice",
        ),
        ClaimError::NotSupported { .. } => (
            "UnsupportedDeviceConfig",
            "change the opaque device config (spec.devices.config of the claim or its \
             DeviceClass) as the message says and create the claim again",
        ),
        ClaimError::BadConfig { .. }
        | ClaimError::UnknownSource { .. }
        | ClaimError::ConflictingConfigs { .. } => (
            "InvalidDeviceConfig",
            "fix the opaque device config (spec.devices.config of the claim or its \
             DeviceClass) and create the claim again",
        ),
        ClaimError::SharingOnShare { .. } | ClaimError::MpsShareNotAlone { .. } => (
            "InvalidShare",
            "fix the claim as the message says and create it again",
        ),
        ClaimError::NotShared { .. } | ClaimError::BadShare { .. } => (
            "ShareNotOffered",
            "the allocation asks for a share this node does not publish (sharing turned off, \
             or a stale ResourceSlice); delete the pod and its claim to get a fresh allocation",
        ),
        ClaimError::UnknownDevice { .. } | ClaimError::OtherPool { .. } => (
            "DeviceNotOnNode",
            "the allocation names a device this node does not publish (a stale \
             ResourceSlice?); delete the pod and its claim to get a fresh allocation",
        ),
        _ => return None,
    })
}

/// Why one claim could not be unprepared (the claim is named by the caller). The same words as
/// the [`PrepareError`] of the same step.
#[derive(Debug, thiserror::Error)]
pub enum UnprepareError {
    #[error("{}", chain(.cause))]
    Checkpoint { cause: CheckpointError },
    #[error("{}", chain(.cause))]
    Spec { cause: WriteError },
    /// The blocking-pool job that removes the claim's files panicked (a bug).
    #[error("the file-writing job failed: {0}")]
    Worker(String),
    /// A dynamic MIG instance of the claim could not be destroyed.
    #[error("device {device}: could not destroy its MIG instance: {}", chain(.cause))]
    Mig {
        device: String,
        cause: crate::source::MigChangeError,
    },
}

impl From<tokio::task::JoinError> for PrepareError {
    fn from(e: tokio::task::JoinError) -> Self {
        PrepareError::Worker(e.to_string())
    }
}

impl From<tokio::task::JoinError> for UnprepareError {
    fn from(e: tokio::task::JoinError) -> Self {
        UnprepareError::Worker(e.to_string())
    }
}

impl From<CheckpointError> for UnprepareError {
    fn from(source: CheckpointError) -> Self {
        UnprepareError::Checkpoint { cause: source }
    }
}

impl From<WriteError> for UnprepareError {
    fn from(source: WriteError) -> Self {
        UnprepareError::Spec { cause: source }
    }
}

impl From<CheckpointError> for PrepareError {
    fn from(source: CheckpointError) -> Self {
        PrepareError::Checkpoint { cause: source }
    }
}

impl From<WriteError> for PrepareError {
    fn from(source: WriteError) -> Self {
        PrepareError::Spec { cause: source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi;

    #[test]
    fn failures_a_user_can_act_on_become_events_naming_what_to_do() {
        let unhealthy = PrepareError::Plan {
            cause: ClaimError::Unhealthy {
                device: "gpu-0".into(),
                uuid: "GPU-0".into(),
                cause: "critical Xid 48".into(),
            },
        };
        let ev = unhealthy.user_event().unwrap();
        assert_eq!(ev.reason, "DeviceUnhealthy");
        assert!(
            ev.note.contains("gpu-0") && ev.note.contains("Xid 48"),
            "{}",
            ev.note
        );
        assert!(ev.note.contains("delete this claim's pod"), "{}", ev.note);
        let missing = PrepareError::MissingDeviceNodes(DeviceNodesError {
            problems: vec![cdi::NodeProblem {
                path: "/dev/nvidia0".into(),
                fault: cdi::NodeFault::Missing,
            }],
        });
        assert_eq!(missing.user_event().unwrap().reason, "DeviceNodesMissing");
        let mps = PrepareError::Plan {
            cause: ClaimError::NotSupported {
                index: 0,
                origin: gpuplane_model::dra::claims::ConfigSource::FromClaim,
                devices: "gpu-0".into(),
                cause: gpuplane_model::dra::opaque::OpaqueError::NotSupported {
                    field: "sharing.strategy".into(),
                    value: "MPS".into(),
                    why: "no daemon",
                },
            },
        };
        let ev = mps.user_event().unwrap();
        assert_eq!(ev.reason, "UnsupportedDeviceConfig");
        assert!(ev.note.contains("sharing.strategy: MPS"), "{}", ev.note);
        // Node-local I/O: logged, not shown to users.
        let bad = PrepareError::Worker("the job panicked".into());
        assert_eq!(bad.user_event(), None);
    }

    #[test]
    fn long_notes_are_cut_at_a_character_boundary_under_the_api_limit() {
        let cut = truncate("é".repeat(600), MAX_NOTE_BYTES);
        assert!(cut.len() <= MAX_NOTE_BYTES, "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert_eq!(truncate("short".into(), MAX_NOTE_BYTES), "short");
    }
}
