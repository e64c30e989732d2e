//! The agent's shared state: one snapshot of inventory, plan, topology and health that every
//! server reads, two generation counters that wake watchers when it changes, and the agent's own
//! counters for `/metrics` (outside the lock).
//!
//! Holds change on every hand-out and release, the node (inventory, config, plan, health)
//! rarely. Only ListAndWatch and the ResourceSlices show holds, so only their watchers wake for a
//! hold: a NodePrepare does not make the labeler, the node CDI spec, the health marks and the
//! DRA health stream look again.
//!
//! A std `RwLock` (not tokio's): critical sections are short, never span an `.await`, and the
//! blocking event pump thread writes to it too.

use crate::config::AgentConfig;
use crate::health::HealthBook;
use crate::inventory::Inventory;
use crate::ledger::{device_plugin_view, Ledger};
use crate::metrics::AgentCounters;
use crate::source::MigRequest;
use crate::topology::TopologyModel;
use gpuplane_model::deviceplugin::resources::{self, Plan, PlanError};
use gpuplane_model::dynamic_mig;
use std::collections::BTreeSet;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio::sync::watch;

/// Everything the servers answer from.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub inventory: Inventory,
    pub config: AgentConfig,
    pub plan: Plan,
    pub model: TopologyModel,
    pub health: HealthBook,
    /// Who holds which unit, across both kubelet APIs.
    pub ledger: Ledger,
    /// True from a (re)start until the first PodResources listing has told the ledger what the
    /// device plugin API holds (the kubelet keeps those assignments across our restarts). While
    /// true, the ledger may lack holds: no ResourceSlice is written and no claim is prepared.
    /// False where nothing follows PodResources (the device plugin API is off).
    pub awaiting_device_plugin_holds: bool,
    /// The dynamic MIG instances the DRA checkpoint records (created or about to be): the
    /// instances gpuplane made, told apart from those another tool made on a dynamic GPU.
    pub mig_owned: BTreeSet<MigRequest>,
}

impl Snapshot {
    pub fn new(inventory: Inventory, config: AgentConfig) -> Result<Snapshot, PlanError> {
        Snapshot::with_mig_owned(inventory, config, BTreeSet::new())
    }

    /// [`Snapshot::new`] knowing which MIG instances gpuplane made (the DRA checkpoint's), so
    /// its dynamic GPUs are told apart from GPUs with another tool's instances from the start.
    pub fn with_mig_owned(
        mut inventory: Inventory,
        config: AgentConfig,
        mig_owned: BTreeSet<MigRequest>,
    ) -> Result<Snapshot, PlanError> {
        mark_dynamic(&mut inventory, None, &config, &mig_owned);
        let plan = resources::plan(&device_plugin_view(&inventory, &config.allocation), &config)?;
        let model = TopologyModel::new(&inventory);
        let mut health = HealthBook::default();
        health.set_inventory(&inventory);
        let ledger = Ledger::new(&inventory);
        Ok(Snapshot {
            inventory,
            config,
            plan,
            model,
            health,
            ledger,
            awaiting_device_plugin_holds: false,
            mig_owned,
        })
    }

    /// Replaces inventory and/or config, keeping health marks of units that still exist.
    pub fn replace_inventory(
        &mut self,
        mut inventory: Inventory,
        config: AgentConfig,
    ) -> Result<(), PlanError> {
        mark_dynamic(
            &mut inventory,
            Some(&self.inventory),
            &config,
            &self.mig_owned,
        );
        let plan = resources::plan(&device_plugin_view(&inventory, &config.allocation), &config)?;
        self.model = TopologyModel::new(&inventory);
        self.health.set_inventory(&inventory);
        self.ledger.set_inventory(&inventory);
        self.plan = plan;
        self.inventory = inventory;
        self.config = config;
        Ok(())
    }
}

#[derive(Debug)]
pub struct NodeState {
    snapshot: RwLock<Snapshot>,
    /// Bumped by every node change (not by holds alone).
    generation: watch::Sender<u64>,
    /// Bumped by every change, holds included.
    any: watch::Sender<u64>,
    /// What this agent counted (config reloads, Events on claims), for `/metrics`.
    counters: AgentCounters,
}

impl NodeState {
    pub fn new(snapshot: Snapshot) -> NodeState {
        NodeState {
            snapshot: RwLock::new(snapshot),
            generation: watch::channel(0).0,
            any: watch::channel(0).0,
            counters: AgentCounters::default(),
        }
    }

    /// This agent's own counters (not the process-wide families; see [`AgentCounters`]).
    pub fn counters(&self) -> &AgentCounters {
        &self.counters
    }

    /// Read access; hold it only for computing an answer.
    pub fn read(&self) -> RwLockReadGuard<'_, Snapshot> {
        // A panic while holding the lock cannot leave a half-updated snapshot: every writer
        // computes the new value first and assigns it whole, so a poisoned lock is still good.
        self.snapshot.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Snapshot> {
        self.snapshot.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `f`; if it reports a change of the node (inventory, config, plan, health), wakes
    /// every watcher.
    pub fn update<R>(&self, f: impl FnOnce(&mut Snapshot) -> (R, bool)) -> R {
        let (result, changed) = f(&mut self.write());
        if changed {
            self.generation.send_modify(|g| *g += 1);
            self.any.send_modify(|g| *g += 1);
        }
        result
    }

    /// Applies `f`, which changes only the ledger (and whether the device plugin's holds are
    /// known); if it reports a change, wakes the watchers of holds ([`NodeState::subscribe_holds`]).
    pub fn update_holds<R>(&self, f: impl FnOnce(&mut Snapshot) -> (R, bool)) -> R {
        let (result, changed) = f(&mut self.write());
        if changed {
            self.any.send_modify(|g| *g += 1);
        }
        result
    }

    /// A receiver that wakes on every change of the node, not on holds alone.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// A receiver that wakes on every change, holds included.
    pub fn subscribe_holds(&self) -> watch::Receiver<u64> {
        self.any.subscribe()
    }

    /// How many node changes there have been: equal numbers, an unchanged node.
    pub fn node_generation(&self) -> u64 {
        *self.generation.borrow()
    }

    /// Waits until the ledger knows the device plugin's holds
    /// ([`Snapshot::awaiting_device_plugin_holds`] false), at most until `deadline` (`None`:
    /// for as long as it takes); whether they are known.
    pub async fn device_plugin_holds_known(&self, deadline: Option<tokio::time::Instant>) -> bool {
        if !self.read().awaiting_device_plugin_holds {
            return true;
        }
        // Subscribed before the next look: an update in between still wakes us.
        let mut changes = self.subscribe_holds();
        loop {
            if !self.read().awaiting_device_plugin_holds {
                return true;
            }
            let changed = match deadline {
                Some(d) => tokio::time::timeout_at(d, changes.changed())
                    .await
                    .unwrap_or(Ok(())),
                None => changes.changed().await,
            };
            let expired = deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
            if changed.is_err() || expired {
                return !self.read().awaiting_device_plugin_holds;
            }
        }
    }
}

/// Marks the GPUs that take part in dynamic MIG under `config` (logging, once per change, why
/// a selected GPU does not). An instance of ours that `previous` had and a rediscovery that
/// began before it was created lacks is kept: the checkpoint, not a stale read, says it exists.
fn mark_dynamic(
    inv: &mut Inventory,
    previous: Option<&Inventory>,
    config: &AgentConfig,
    owned: &BTreeSet<MigRequest>,
) {
    for g in &mut inv.gpus {
        g.mig.dynamic = false;
    }
    let Some(cfg) = config.dynamic_mig.as_ref() else {
        return;
    };
    let is_owned = |g: &crate::inventory::Gpu, m: &crate::inventory::MigDevice| {
        owned.contains(&MigRequest {
            gpu: g.uuid.clone(),
            profile: m.profile.to_string(),
            start: m.placement.start,
        })
    };
    if let Some(prev) = previous {
        for g in &mut inv.gpus {
            let Some(old) = prev.gpus.iter().find(|p| p.uuid == g.uuid) else {
                continue;
            };
            for m in old.mig_devices.iter().filter(|m| is_owned(old, m)) {
                if !g.mig_devices.iter().any(|d| d.uuid == m.uuid) {
                    g.mig_devices.push(m.clone());
                }
            }
            g.mig_devices
                .sort_by_key(|d| (d.gpu_instance_id, d.compute_instance_id));
        }
    }
    let participation = dynamic_mig::plan(inv, cfg, &is_owned);
    let before: BTreeSet<u32> = previous
        .map(|p| {
            p.gpus
                .iter()
                .filter(|g| g.mig.dynamic)
                .map(|g| g.index)
                .collect()
        })
        .unwrap_or_default();
    dynamic_mig::mark(inv, &participation);
    let now: BTreeSet<u32> = inv
        .gpus
        .iter()
        .filter(|g| g.mig.dynamic)
        .map(|g| g.index)
        .collect();
    if previous.is_none() || before != now {
        for r in &participation.refused {
            tracing::warn!(gpu = r.index, "not partitioned dynamically: {}", r.reason);
        }
        for p in &participation.gpus {
            tracing::info!(
                gpu = p.index,
                table = p.table.name,
                "dynamic MIG: gpuplane creates this GPU's MIG instances as claims need them"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> NodeState {
        let inventory = Inventory {
            driver_version: String::new(),
            cuda_driver_version: String::new(),
            gpus: Vec::new(),
            topology: crate::inventory::Topology::default(),
        };
        NodeState::new(Snapshot::new(inventory, AgentConfig::default()).unwrap())
    }

    #[test]
    fn a_hold_wakes_only_the_watchers_of_holds_and_a_node_change_wakes_all() {
        let s = state();
        let mut node = s.subscribe();
        let mut holds = s.subscribe_holds();
        s.update_holds(|_| ((), true));
        assert!(!node.has_changed().unwrap(), "a hold woke a node watcher");
        assert!(
            holds.has_changed().unwrap(),
            "a hold did not wake a watcher of holds"
        );
        holds.mark_unchanged();
        let before = s.node_generation();
        s.update(|_| ((), true));
        assert!(node.has_changed().unwrap());
        assert!(holds.has_changed().unwrap());
        assert_eq!(s.node_generation(), before + 1);
        node.mark_unchanged();
        holds.mark_unchanged();
        s.update(|_| ((), false));
        s.update_holds(|_| ((), false));
        assert!(!node.has_changed().unwrap() && !holds.has_changed().unwrap());
    }
}
