//! The agent's shared state: one snapshot of inventory, plan, topology and health that every
//! server reads, and a generation counter that wakes watchers when it changes.
//!
//! A std `RwLock` (not tokio's): critical sections are short, never span an `.await`, and the
//! blocking event pump thread writes to it too.

use crate::config::AgentConfig;
use crate::deviceplugin::resources::{self, Plan, PlanError};
use crate::health::HealthBook;
use crate::inventory::Inventory;
use crate::ledger::{device_plugin_view, Ledger};
use crate::topology::TopologyModel;
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
}

impl Snapshot {
    pub fn new(inventory: Inventory, config: AgentConfig) -> Result<Snapshot, PlanError> {
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
        })
    }

    /// Replaces inventory and/or config, keeping health marks of units that still exist.
    pub fn replace(&mut self, inventory: Inventory, config: AgentConfig) -> Result<(), PlanError> {
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
    generation: watch::Sender<u64>,
}

impl NodeState {
    pub fn new(snapshot: Snapshot) -> NodeState {
        NodeState {
            snapshot: RwLock::new(snapshot),
            generation: watch::channel(0).0,
        }
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

    /// Applies `f`; if it reports a change, wakes every watcher.
    pub fn update<R>(&self, f: impl FnOnce(&mut Snapshot) -> (R, bool)) -> R {
        let (result, changed) = f(&mut self.write());
        if changed {
            self.generation.send_modify(|g| *g += 1);
        }
        result
    }

    /// A receiver that wakes on every change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Waits until the ledger knows the device plugin's holds
    /// ([`Snapshot::awaiting_device_plugin_holds`] false), at most until `deadline` (`None`:
    /// for as long as it takes); whether they are known.
    pub async fn device_plugin_holds_known(&self, deadline: Option<tokio::time::Instant>) -> bool {
        if !self.read().awaiting_device_plugin_holds {
            return true;
        }
        // Subscribed before the next look: an update in between still wakes us.
        let mut changes = self.subscribe();
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
