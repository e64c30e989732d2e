//! The tasks around the state owner ([`super::owner`]). Each reads one part of the world and
//! posts what it found; none holds the state lock while it waits:
//!
//! - the event pump, a thread of its own because NVML's event wait blocks;
//! - the config watcher: SIGHUP, or the file's mtime changing (looked at every 250 ms);
//! - the inventory refresher: the device source's `discover` on the blocking pool every
//!   `inventoryRefresh`, one at a time, so a hung NVML holds up only the next refresh;
//! - the node CDI spec keeper: writes the spec (on the blocking pool) when the inventory
//!   changes, and every second while device nodes are missing.

use super::owner::Input;
use crate::cdi::node_spec::{NodeSpec, SpecState};
use crate::config::{AgentConfig, ConfigError};
use crate::inventory::Inventory;
use crate::source::DeviceSource;
use crate::state::NodeState;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::{mpsc, watch};

/// The agent config at `path` (the defaults when the agent has no config file), with the
/// node's sharing switch applied.
pub fn load_config(path: Option<&Path>, sharing: Option<bool>) -> Result<AgentConfig, ConfigError> {
    let mut config = match path {
        Some(p) => AgentConfig::load(p)?,
        None => AgentConfig::default(),
    };
    config.shares = crate::sharing::ShareConfig::for_node(config.shares.take(), sharing);
    Ok(config)
}

/// Reads driver events on a thread of its own (NVML's wait blocks) and posts them.
pub fn spawn_event_pump(
    source: Arc<dyn DeviceSource>,
    inputs: mpsc::UnboundedSender<Input>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut failing = false;
        while !stop.load(Ordering::Relaxed) {
            match source.next_event(Duration::from_millis(200)) {
                Ok(Some(event)) => {
                    failing = false;
                    if inputs.send(Input::Device(event)).is_err() {
                        return;
                    }
                }
                Ok(None) => failing = false,
                Err(e) => {
                    if !failing {
                        tracing::error!(error = %e, "waiting for driver events failed; retrying");
                    }
                    failing = true;
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    })
}

/// Reads the config file again on SIGHUP or when its mtime changes, and posts it.
pub async fn watch_config(
    path: Option<PathBuf>,
    sharing: Option<bool>,
    mut hangup: tokio::signal::unix::Signal,
    inputs: mpsc::UnboundedSender<Input>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = mtime(path.as_deref()).await;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = hangup.recv() => tracing::info!("SIGHUP: reloading config"),
            _ = tick.tick() => {
                let now = mtime(path.as_deref()).await;
                if now == seen {
                    continue;
                }
                seen = now;
                tracing::info!("config file changed: reloading");
            }
        }
        let p = path.clone();
        let read = tokio::task::spawn_blocking(move || load_config(p.as_deref(), sharing)).await;
        // A panicking read is a bug in the parser; the running config stays.
        let Ok(config) = read else { continue };
        if inputs.send(Input::Config(config)).is_err() {
            return;
        }
    }
}

async fn mtime(path: Option<&Path>) -> Option<SystemTime> {
    let meta = tokio::fs::metadata(path?).await.ok()?;
    meta.modified().ok()
}

/// Rediscovers every `inventoryRefresh` (read from the running config each round) and posts
/// the result. A discovery that hangs is not waited for at shutdown.
pub async fn refresh_inventory(
    source: Arc<dyn DeviceSource>,
    state: Arc<NodeState>,
    inputs: mpsc::UnboundedSender<Input>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let every = state.read().config.inventory_refresh;
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let s = source.clone();
        let found = tokio::select! {
            _ = stop.changed() => return,
            found = tokio::task::spawn_blocking(move || s.discover()) => found,
        };
        let found = match found {
            Ok(Ok(found)) => Ok(found),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("discovery panicked: {e}")),
        };
        if inputs.send(Input::Rediscovered(found)).is_err() {
            return;
        }
    }
}

/// Keeps the node CDI spec in step with the inventory until `stop`.
pub async fn keep_node_spec(
    spec: Arc<NodeSpec>,
    state: Arc<NodeState>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = state.subscribe();
    let mut retry = tokio::time::interval(Duration::from_secs(1));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut written = state.read().inventory.clone();
    let mut synced = sync_spec(&spec, written.clone()).await;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
                // Most changes are health or holds; only a new inventory needs a new spec.
                let s = state.read();
                if s.inventory == written {
                    continue;
                }
                written = s.inventory.clone();
            }
            _ = retry.tick(), if synced == SpecState::Waiting => {}
            // Allocate found the spec not current: sync the latest inventory now.
            () = spec.retry_requested() => written = state.read().inventory.clone(),
        }
        synced = sync_spec(&spec, written.clone()).await;
    }
}

/// Brings the node CDI spec in step with `inv` on the blocking pool (it writes and fsyncs).
async fn sync_spec(node_spec: &Arc<NodeSpec>, inv: Inventory) -> SpecState {
    let spec = node_spec.clone();
    tokio::task::spawn_blocking(move || spec.sync(&inv))
        .await
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "writing the node CDI spec panicked; retrying");
            SpecState::Waiting
        })
}
