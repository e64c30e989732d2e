//! Dynamic MIG instances of a claim: created before its devices are planned, destroyed when it
//! is unprepared, and made to match the checkpoint when the agent starts.
//!
//! The checkpoint is written before each change to the hardware and after it:
//!
//! 1. the claim's entry (state `PrepareStarted`) records every instance it needs (the intent);
//! 2. each missing instance is created through the source;
//! 3. the new MIG devices go into the node's inventory, where the claim's dynamic device names
//!    now resolve to them ([`crate::inventory::Inventory::dra_device`]), and the claim is
//!    planned, held and written as any other: its `PrepareCompleted` entry records each
//!    instance's GPU instance id and UUID. The intent alone already says which instance is
//!    the claim's (its placement), so this costs a dynamic prepare one durable write more than
//!    a static one, not two; a failed prepare records what it made before it answers.
//!
//! An instance is ours exactly when an entry records it, created or intended (the same GPU,
//! profile and start): placements never overlap, so at most one instance matches. A kill after
//! step 1 leaves an intent, which the kubelet's retry fulfils; a kill after a create and
//! before its record leaves an instance the retry adopts. Unprepare destroys the instances
//! before the entry goes, so an instance no entry records was not made by gpuplane and is never
//! touched. An entry that says prepared but whose instance is gone (destroyed behind our back,
//! or a kill between destroy and record) goes back to `PrepareStarted` at start: a prepare retry
//! creates it again (with a new UUID, as NVML gives), an unprepare retry finishes the job.

use super::{claim_label, PrepareError, UnprepareError};
use crate::dra::checkpoint::{Checkpoint, ClaimEntry, ClaimState, CreatedMig, MigEntry};
use crate::dra::ClaimRef;
use crate::inventory::{Inventory, MigDevice};
use crate::source::{DeviceSource, MigChangeError, MigRequest};
use crate::state::{NodeState, Snapshot};
use gpuplane_model::dynamic_mig;
use k8s_openapi::api::resource::v1::ResourceClaim;
use std::sync::Arc;
use tracing::{info, warn};

/// The dynamic MIG instances of this driver's claims: made and destroyed through the device
/// source, and kept in the node's inventory.
pub(super) struct Instances {
    /// The driver and pool whose claims' results name dynamic devices.
    driver: String,
    pool: String,
    /// The node state whose inventory holds the instances, and which of them are ours.
    state: Arc<NodeState>,
    /// Where dynamic MIG instances are created and destroyed.
    source: Arc<dyn DeviceSource>,
}

/// The instance a MIG entry stands for, if it exists in `inv`: the one at its GPU, profile and
/// start.
pub(crate) fn existing<'i>(inv: &'i Inventory, r: &MigRequest) -> Option<&'i MigDevice> {
    inv.gpus
        .iter()
        .find(|g| g.uuid == r.gpu)?
        .mig_devices
        .iter()
        .find(|m| m.placement.start == r.start && m.profile.as_str() == r.profile)
}

/// The dynamic devices among the claim's results for this driver and pool, with what creating
/// each means. Names that are not dynamic devices are left to the planner, which refuses
/// unknown ones.
fn wanted(claim: &ResourceClaim, driver: &str, pool: &str, inv: &Inventory) -> Vec<MigEntry> {
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let mut out: Vec<MigEntry> = Vec::new();
    for r in results.into_iter().flatten() {
        if r.driver != driver || r.pool != pool || out.iter().any(|e| e.device == r.device) {
            continue;
        }
        if let Some(d) = dynamic_mig::device(inv, &r.device) {
            out.push(MigEntry {
                device: r.device.clone(),
                request: d.to_request(),
                created: None,
            });
        }
    }
    out
}

impl Instances {
    pub(super) fn new(
        driver: &str,
        pool: &str,
        state: Arc<NodeState>,
        source: Arc<dyn DeviceSource>,
    ) -> Instances {
        Instances {
            driver: driver.to_string(),
            pool: pool.to_string(),
            state,
            source,
        }
    }

    /// Steps 1 and 2 of the module docs for `claim`; the instances are in the inventory when
    /// it returns, and the entries the prepared claim records are returned.
    pub(super) fn create_instances(
        &self,
        cp: &mut Checkpoint,
        claim: &ResourceClaim,
        c: &ClaimRef,
    ) -> Result<Vec<MigEntry>, PrepareError> {
        // Most claims have no dynamic device: no copy of the inventory for them.
        let (inv, mut wanted) = {
            let snap = self.state.read();
            let wanted = wanted(claim, &self.driver, &self.pool, &snap.inventory);
            if wanted.is_empty() {
                return Ok(wanted);
            }
            (snap.inventory.clone(), wanted)
        };
        // Records of an earlier attempt keep what they know (the created instance).
        let earlier = cp
            .get(&c.uid)
            .map(|e| e.instances.clone())
            .unwrap_or_default();
        for w in &mut wanted {
            if let Some(e) = earlier.iter().find(|e| e.request == w.request) {
                w.created = e.created.clone();
            }
        }
        let fresh = cp.get(&c.uid).is_none();
        self.record(cp, c, &wanted)?;
        crate::crashpoint::reached(crate::crashpoint::Step::PrepareAfterMigIntent);
        let (made, failed) = self.make(&inv, c, &mut wanted);
        if failed.is_some() {
            // Intents that were not fulfilled go; instances made stay recorded (the kubelet's
            // unprepare or retry takes it from there), and a claim that made none leaves no
            // entry behind.
            wanted.retain(|w| w.created.is_some());
            if wanted.is_empty() && fresh {
                cp.update(|d| {
                    d.claims.remove(c.uid.as_str());
                })?;
                self.sync_owned(cp);
            } else {
                self.record(cp, c, &wanted)?;
            }
        }
        self.state.update(|s| {
            let changed = !made.is_empty();
            let mut inv = s.inventory.clone();
            for m in made {
                insert(&mut inv, m);
            }
            install(s, inv);
            ((), changed)
        });
        failed.map_or(Ok(wanted), Err)
    }

    /// Creates (or, after a kill between create and record, adopts) each instance `wanted`
    /// has not made yet, stopping at the first failure; the devices made, and that failure.
    fn make(
        &self,
        inv: &Inventory,
        c: &ClaimRef,
        wanted: &mut [MigEntry],
    ) -> (Vec<MigDevice>, Option<PrepareError>) {
        let mut made: Vec<MigDevice> = Vec::new();
        for w in wanted.iter_mut().filter(|w| w.created.is_none()) {
            let device = match existing(inv, &w.request) {
                // The intent says an instance there is ours.
                Some(m) => m.clone(),
                None => match self.source.create_mig(&w.request) {
                    Ok(m) => {
                        crate::crashpoint::reached(crate::crashpoint::Step::PrepareAfterMigCreate);
                        info!(claim = %claim_label(c), device = %w.device, uuid = %m.uuid,
                            gpu_instance = m.gpu_instance_id, "created MIG instance");
                        m
                    }
                    Err(cause) => {
                        let failed = PrepareError::Mig {
                            device: w.device.clone(),
                            action: "create",
                            cause,
                        };
                        return (made, Some(failed));
                    }
                },
            };
            w.created = Some(CreatedMig {
                gpu_instance_id: device.gpu_instance_id,
                uuid: device.uuid.clone(),
            });
            made.push(device);
        }
        (made, None)
    }

    /// Writes the claim's entry with `instances` (a new entry starts as `PrepareStarted`),
    /// unsynced; no write when nothing changed.
    fn record(
        &self,
        cp: &mut Checkpoint,
        c: &ClaimRef,
        instances: &[MigEntry],
    ) -> Result<(), PrepareError> {
        if cp.get(&c.uid).is_some_and(|e| e.instances == instances) {
            return Ok(());
        }
        let mut entry = cp.get(&c.uid).cloned().unwrap_or_else(|| ClaimEntry {
            namespace: c.namespace.to_string(),
            name: c.name.to_string(),
            state: ClaimState::PrepareStarted,
            devices: Vec::new(),
            cdi_spec_stem: super::spec_stem(&c.uid),
            units: Default::default(),
            cdi_spec: None,
            shares: Vec::new(),
            instances: Vec::new(),
        });
        entry.instances = instances.to_vec();
        // What it records goes with a reboot: no fdatasync (see `update_until_reboot`).
        cp.update_until_reboot(|d| {
            d.claims.insert(c.uid.to_string(), entry);
        })?;
        self.sync_owned(cp);
        Ok(())
    }

    /// The node's idea of which instances are ours follows the checkpoint.
    fn sync_owned(&self, cp: &Checkpoint) {
        let owned = cp.data().mig_owned();
        self.state.update(|s| {
            s.mig_owned = owned;
            ((), false)
        });
    }

    /// Destroys the instances an entry records (unprepare), and takes them out of the
    /// inventory. An instance already gone is fine.
    pub(super) fn destroy_instances(
        &self,
        c: &ClaimRef,
        instances: &[MigEntry],
    ) -> Result<(), UnprepareError> {
        if instances.is_empty() {
            return Ok(());
        }
        let inv = self.state.read().inventory.clone();
        for m in instances {
            let gi = match (&m.created, existing(&inv, &m.request)) {
                (_, Some(found)) => found.gpu_instance_id,
                (Some(created), None) => created.gpu_instance_id,
                (None, None) => continue,
            };
            match self.source.destroy_mig(&m.request.gpu, gi) {
                Ok(()) => {
                    info!(claim = %claim_label(c), device = %m.device, gpu_instance = gi,
                        "destroyed MIG instance")
                }
                Err(MigChangeError::NotFound(_)) => {}
                Err(cause) => {
                    return Err(UnprepareError::Mig {
                        device: m.device.clone(),
                        cause,
                    })
                }
            }
            crate::crashpoint::reached(crate::crashpoint::Step::UnprepareAfterMigDestroy);
        }
        Ok(())
    }

    /// After the entry is gone: the instances leave the inventory and stop being ours.
    pub(super) fn forget_instances(&self, instances: &[MigEntry]) {
        if instances.is_empty() {
            return;
        }
        self.state.update(|s| {
            let mut inv = s.inventory.clone();
            for m in instances {
                s.mig_owned.remove(&m.request);
                if let Some(g) = inv.gpus.iter_mut().find(|g| g.uuid == m.request.gpu) {
                    g.mig_devices.retain(|d| {
                        !(d.placement.start == m.request.start
                            && d.profile.as_str() == m.request.profile)
                    });
                }
            }
            install(s, inv);
            ((), true)
        });
    }

    /// Start-up: the node learns which instances are ours, created instances the checkpoint
    /// misses are recorded, and prepared claims whose instance is gone are prepared again on
    /// the kubelet's retry. Returns whether the checkpoint changed.
    pub(super) fn reconcile_instances(&self, cp: &mut Checkpoint) -> bool {
        let inv = self.state.read().inventory.clone();
        let mut changed = Vec::new();
        for (uid, entry) in &cp.data().claims {
            let mut e = entry.clone();
            for m in &mut e.instances {
                match existing(&inv, &m.request) {
                    Some(found) => {
                        m.created = Some(CreatedMig {
                            gpu_instance_id: found.gpu_instance_id,
                            uuid: found.uuid.clone(),
                        })
                    }
                    None if e.state == ClaimState::PrepareCompleted => {
                        warn!(claim = %format!("{}/{}", e.namespace, e.name), device = %m.device,
                            "the MIG instance of a prepared claim is gone; the claim is prepared again when the kubelet retries");
                        e.state = ClaimState::PrepareStarted;
                        e.cdi_spec = None;
                        m.created = None;
                    }
                    None => m.created = None,
                }
            }
            if e != *entry {
                changed.push((uid.clone(), e));
            }
        }
        let owned = cp.data().mig_owned();
        self.state.update(|s| {
            s.mig_owned = owned;
            let inv = s.inventory.clone();
            install(s, inv);
            ((), true)
        });
        if changed.is_empty() {
            return false;
        }
        if let Err(e) = cp.update(|d| d.claims.extend(changed)) {
            warn!(error = %e, "recording the MIG instances found at start failed; retried on the next prepare");
        }
        true
    }
}

/// Puts a MIG device under its GPU, keeping the (GPU instance, compute instance) order.
fn insert(inv: &mut Inventory, m: MigDevice) {
    if let Some(g) = inv.gpus.iter_mut().find(|g| g.uuid == m.parent_uuid) {
        g.mig_devices.retain(|d| d.uuid != m.uuid);
        g.mig_devices.push(m);
        g.mig_devices
            .sort_by_key(|d| (d.gpu_instance_id, d.compute_instance_id));
    }
}

/// Installs an inventory into the snapshot, keeping the config; a plan error (which the same
/// config did not give before) keeps the old inventory.
fn install(s: &mut Snapshot, inv: Inventory) {
    let config = s.config.clone();
    if let Err(e) = s.replace_inventory(inv, config) {
        warn!(error = %e, "the inventory with the MIG instances changed could not be planned");
    }
}
