//! The state owner: the one task that changes the node's inventory, config and health.
//!
//! The tasks around it ([`super::tasks`]: the driver event pump, the config watcher, the
//! inventory refresher) only read from the world and post what they found here as an
//! [`Input`]; the owner applies each under the state lock with pure calls (the health book,
//! `Snapshot::replace`) and never waits on a device, a file or the network, so a hung NVML
//! call delays only the one reading that is waiting for it. The kubelet-facing servers change
//! nothing but the ledger, under the same lock, because their answers must be synchronous.
//! Every turn ticks the readiness clock behind `/healthz`.

use super::http::Readiness;
use super::lost_gpus::Prober;
use crate::config::{AgentConfig, ConfigError};
use crate::health::{Cause, Change, Health};
use crate::inventory::{DeviceUuid, Inventory};
use crate::metrics::ConfigReload;
use crate::source::{DeviceEvent, Discovery};
use crate::state::{NodeState, Snapshot};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How often the owner expires Xids and asks the probe thread about lost GPUs.
const TICK: Duration = Duration::from_millis(250);

/// What the tasks around the owner post to it.
#[derive(Debug)]
pub enum Input {
    /// An event from the driver (the event pump thread).
    Device(DeviceEvent),
    /// The config file, read again after SIGHUP or a change (the config watcher).
    Config(Result<AgentConfig, ConfigError>),
    /// A periodic rediscovery finished (the inventory refresher); the error as text.
    Rediscovered(Result<Discovery, String>),
}

/// The state owner's handle on what it owns.
pub struct Owner {
    pub state: Arc<NodeState>,
    pub prober: Prober,
    pub readiness: Arc<Readiness>,
}

impl Owner {
    /// Applies inputs and ticks until `shutdown` resolves (or every sender is gone).
    pub async fn run(
        mut self,
        mut inputs: mpsc::UnboundedReceiver<Input>,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.readiness.tick();
            tokio::select! {
                _ = &mut shutdown => return,
                input = inputs.recv() => match input {
                    Some(input) => self.apply(input),
                    None => return,
                },
                _ = tick.tick() => self.on_tick(),
            }
        }
    }

    fn apply(&mut self, input: Input) {
        match input {
            Input::Device(event) => self.on_device_event(&event),
            Input::Config(Ok(config)) => {
                let counters = self.state.counters();
                self.state.update(|s| {
                    let inventory = s.inventory.clone();
                    let (running, changed) = replace_running(s, inventory, config);
                    // Counted before the change wakes anyone: whoever sees the new plan (or
                    // the count) sees the other too.
                    counters.config_reload(if running {
                        ConfigReload::Applied
                    } else {
                        ConfigReload::Refused
                    });
                    ((), changed)
                });
            }
            Input::Config(Err(e)) => {
                tracing::error!(error = %e, "config reload failed; keeping the running config");
                self.state.counters().config_reload(ConfigReload::Refused);
            }
            Input::Rediscovered(Ok(found)) => self.on_rediscovered(&found),
            Input::Rediscovered(Err(e)) => {
                tracing::error!(error = %e, "inventory refresh failed; serving the last known inventory")
            }
        }
    }

    /// Xids that went quiet recover; the probe thread's answer is applied, and it is asked
    /// about the GPUs lost now (never under the lock: see `probe`).
    fn on_tick(&mut self) {
        let quiet = self.state.read().config.recovery_quiet_period;
        let mut changes = self.state.update(|s| {
            let c = s.health.expire_xids(Instant::now(), quiet);
            let changed = !c.is_empty();
            (c, changed)
        });
        if let Some(answer) = self.prober.poll() {
            changes.extend(self.state.update(|s| {
                let c = s.health.recover_answered(&answer.answered, answer.asked_at);
                let changed = !c.is_empty();
                (c, changed)
            }));
        }
        let lost = self.state.read().health.lost();
        self.prober.ask(lost);
        log_changes(&changes);
    }

    fn on_device_event(&mut self, event: &DeviceEvent) {
        let DeviceEvent::Xid { xid, .. } = event;
        crate::metrics::node()
            .xid_events
            .get_or_create(&crate::metrics::XidLabel { xid: *xid })
            .inc();
        let change = self.state.update(|s| {
            let c = s
                .health
                .on_event(event, Instant::now(), &s.config.xid_policy);
            let changed = !matches!(c, Change::Ignored { .. });
            (c, changed)
        });
        log_changes(&[change]);
    }

    /// GPUs that stopped answering are marked lost (and stay listed); the rest of the new
    /// inventory is installed with the running config.
    fn on_rediscovered(&mut self, found: &Discovery) {
        let (inventory, config) = {
            let s = self.state.read();
            (s.inventory.clone(), s.config.clone())
        };
        let (inventory, lost) = with_lost(Some(&inventory), found);
        self.state.update(|s| {
            let now = Instant::now();
            let fresh: Vec<&DeviceUuid> = lost
                .iter()
                .filter(|u| s.health.health(u) != Health::Unhealthy(Cause::Lost))
                .collect();
            let newly: Vec<Change> = fresh
                .into_iter()
                .map(|u| s.health.on_lost(u, now))
                .collect();
            log_changes(&newly);
            let changed = !newly.is_empty();
            ((), changed)
        });
        install(&self.state, inventory, config);
    }
}

/// The inventory to serve: what answered, plus GPUs known from before that are now lost (so
/// they stay listed, as Unhealthy, instead of silently vanishing).
pub fn with_lost(previous: Option<&Inventory>, found: &Discovery) -> (Inventory, Vec<DeviceUuid>) {
    let mut inv = found.inventory.clone();
    let mut lost_uuids = Vec::new();
    if let Some(prev) = previous {
        for lost in &found.lost {
            if let Some(g) = prev.gpu(lost.index) {
                if inv.gpu(lost.index).is_none() {
                    inv.gpus.push(g.clone());
                    inv.topology.links.extend(
                        prev.topology
                            .links
                            .iter()
                            .filter(|l| l.from == lost.index || l.to == lost.index)
                            .copied(),
                    );
                }
                lost_uuids.push(g.uuid.clone());
            }
        }
    }
    inv.gpus.sort_by_key(|g| g.index);
    inv.topology.links.sort_by_key(|l| (l.from, l.to));
    inv.topology.links.dedup_by_key(|l| (l.from, l.to));
    (inv, lost_uuids)
}

/// Installs a new inventory and config if they differ from the running ones.
pub fn install(state: &NodeState, inventory: Inventory, config: AgentConfig) {
    state.update(|s| ((), replace_running(s, inventory, config).1));
}

/// Makes `inventory` and `config` the running ones unless they already are: (whether they are
/// the running ones now, whether anything changed). They are refused, the previous plan
/// staying, when they cannot be offered.
fn replace_running(s: &mut Snapshot, inventory: Inventory, config: AgentConfig) -> (bool, bool) {
    if s.inventory == inventory && s.config == config {
        return (true, false);
    }
    let inventory_changed = s.inventory != inventory;
    match s.replace_inventory(inventory, config) {
        Ok(()) => {
            if inventory_changed {
                tracing::info!(
                    gpus = s.inventory.gpus.len(),
                    mig_devices = s.inventory.mig_device_count(),
                    "inventory changed"
                );
            }
            for w in &s.plan.warnings {
                tracing::warn!("{w}");
            }
            (true, true)
        }
        Err(e) => {
            tracing::error!(error = %e, "new inventory or config cannot be offered; keeping the previous plan");
            (false, false)
        }
    }
}

pub fn log_changes(changes: &[Change]) {
    for c in changes {
        match c {
            Change::Unhealthy { unit, cause } => {
                tracing::warn!(device = %unit, %cause, "device unhealthy")
            }
            Change::Recovered { unit, after } => {
                tracing::info!(device = %unit, after = %after, "device healthy again")
            }
            Change::Ignored { unit, xid } => {
                tracing::info!(device = %unit, xid, "Xid ignored by policy")
            }
        }
    }
}
