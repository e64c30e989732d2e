//! A claim's shares and their units' MPS control daemons: started before a share's prepare is
//! recorded, stopped once a unit's last MPS share is unprepared. A crash between a start and
//! the checkpoint write leaves a daemon no share needs, and one between the checkpoint write and
//! a stop leaves one too: the next start's reconcile stops both ([`MpsHost::reconcile`]).
//!
//! [`MpsHost::reconcile`]: crate::mps::MpsHost::reconcile

use super::{PrepareError, UserEvent};
use crate::dra::checkpoint::{CheckpointData, ClaimEntry, ClaimState, ShareEntry};
use crate::inventory::{DeviceUuid, Inventory};
use crate::mps::{DaemonDirs, MpsHost};
use crate::sharing::{self, Enforcement};
use crate::state::NodeState;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tracing::warn;

/// The MPS control daemons of shared units: where they run, and the node state that says which
/// units are shared and by whom.
#[derive(Clone)]
pub(super) struct Daemons {
    state: Arc<NodeState>,
    /// Where the MPS control daemons of shared units run.
    mps: Arc<dyn MpsHost>,
}

/// The units whose MPS shares the checkpoint records as prepared (their daemons must run),
/// each with whether its daemon is multi-user ([`multiuser`]).
pub(super) fn mps_daemons(data: &CheckpointData, inv: &Inventory) -> BTreeMap<DeviceUuid, bool> {
    data.claims
        .values()
        .filter(|e| e.state == ClaimState::PrepareCompleted)
        .flat_map(|e| &e.shares)
        .filter(|s| s.enforcement == Enforcement::Mps)
        .map(|s| (s.unit.clone(), multiuser(inv, s.unit.as_str())))
        .collect()
}

/// Whether `unit`'s daemon can be multi-user: its GPU (or MIG device's parent) is Volta or
/// later (compute capability 7.0+), where NVIDIA's MPS offers multi-user mode.
pub(super) fn multiuser(inv: &Inventory, unit: &str) -> bool {
    inv.gpus
        .iter()
        .find(|g| g.uuid.as_str() == unit || g.mig_devices.iter().any(|m| m.uuid.as_str() == unit))
        .and_then(|g| {
            g.cuda_compute_capability
                .split('.')
                .next()?
                .parse::<u32>()
                .ok()
        })
        .is_some_and(|major| major >= 7)
}

/// The Event for a prepared claim with shares: which of their limits hold how. Time-sliced,
/// memory and compute are scheduling figures; under MPS compute is cooperative, and memory too
/// unless the driver holds it (`gpuplane_model::dra::status::add_share`). Never "enforced"
/// where it is not.
pub(super) fn notice(entry: &ClaimEntry) -> Option<UserEvent> {
    let listed = |e: Enforcement, held: bool| -> Vec<String> {
        entry
            .shares
            .iter()
            .filter(|s| s.enforcement == e && (e != Enforcement::Mps || s.memory_held == held))
            .map(|s| format!("{} ({})", s.device, s.share))
            .collect()
    };
    let sliced = listed(Enforcement::TimeSlicing, false);
    let (mps, held) = (
        listed(Enforcement::Mps, false),
        listed(Enforcement::Mps, true),
    );
    let mut parts = Vec::new();
    if !sliced.is_empty() {
        parts.push(format!(
            "prepared as time-sliced shares of {}: their memory and compute are scheduling \
             figures, not limits, because this node runs no MPS control daemon for them (no \
             nvidia-cuda-mps-control in the driver root, or enforcement: TimeSlicing)",
            sliced.join(", ")
        ));
    }
    if !mps.is_empty() {
        parts.push(format!(
            "prepared as MPS shares of {}: MPS runs them beside the GPU's other shares, but \
             their memory and compute limits are cooperative only, set in the container's \
             environment (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), \
             which a container can unset or raise",
            mps.join(", ")
        ));
    }
    if !held.is_empty() {
        parts.push(format!(
            "prepared as MPS shares of {}: the driver holds each container to its memory (a \
             per-cgroup limit set outside the container), but their compute limit is \
             cooperative only, set in the container's environment \
             (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), which a container can unset or raise",
            held.join(", ")
        ));
    }
    (!parts.is_empty()).then(|| UserEvent {
        reason: "ShareLimitsNotEnforced",
        note: parts.join("; "),
    })
}

impl Daemons {
    pub(super) fn new(state: Arc<NodeState>, mps: Arc<dyn MpsHost>) -> Daemons {
        Daemons { state, mps }
    }

    /// The shared units of `inv`; MPS becomes time-slicing where the driver root has no MPS
    /// control program (the claim's status and an Event say so).
    pub(super) fn shared_units(
        &self,
        inv: &Inventory,
        cfg: Option<&sharing::ShareConfig>,
    ) -> BTreeMap<DeviceUuid, sharing::UnitShares> {
        let mut units = sharing::shared_units(inv, cfg);
        if !units.is_empty() && !self.mps.available() {
            for u in units.values_mut() {
                u.enforcement = Enforcement::TimeSlicing;
            }
        }
        units
    }

    /// The directories of `unit`'s daemon (its pipe directory, its `/dev/shm`).
    pub(super) fn dirs(&self, unit: &str) -> DaemonDirs {
        self.mps.dirs(unit)
    }

    /// Whether MPS clients mount their daemon's `/dev/shm`.
    pub(super) fn shares_shm(&self) -> bool {
        self.mps.shares_shm()
    }

    /// Starts the daemons `wanted` lists and stops the others (agent start-up).
    pub(super) fn reconcile(&self, wanted: &BTreeMap<DeviceUuid, bool>) {
        self.mps.reconcile(wanted);
    }

    /// Makes sure the daemon of each MPS share's unit runs before the prepare answers.
    pub(super) fn start_daemons(&self, shares: &[ShareEntry]) -> Result<(), PrepareError> {
        let mut started = false;
        for s in shares.iter().filter(|s| s.enforcement == Enforcement::Mps) {
            let multiuser = multiuser(&self.state.read().inventory, s.unit.as_str());
            started |= self
                .mps
                .ensure(&s.unit, multiuser)
                .map_err(|cause| PrepareError::Mps { cause })?;
        }
        if started {
            crate::crashpoint::reached(crate::crashpoint::Step::PrepareAfterMpsStart);
        }
        Ok(())
    }

    /// Stops the daemon of each unit of `shares` that no share holds any more (the claim's
    /// own shares are released already). A failure is logged: the claim is unprepared, and
    /// the next start stops a daemon no share needs.
    pub(super) fn stop_unused_daemons(&self, shares: &[ShareEntry]) {
        let idle: BTreeSet<&DeviceUuid> = {
            let snap = self.state.read();
            shares
                .iter()
                .filter(|s| s.enforcement == Enforcement::Mps)
                .map(|s| &s.unit)
                .filter(|u| snap.ledger.shares_of(u).is_empty())
                .collect()
        };
        for unit in idle {
            crate::crashpoint::reached(crate::crashpoint::Step::UnprepareBeforeMpsStop);
            if let Err(e) = self.mps.stop(unit) {
                warn!(error = %e, "the last share of a GPU is unprepared but its MPS control daemon did not stop");
            }
        }
    }
}
