//! Keeps the node-wide CDI spec (`nvidia.com/gpu`, the names Allocate hands out) in step with
//! the inventory. On real hardware a spec is only written once every device node it names is
//! there and right: a spec cached before the driver created `/dev/nvidia*` gave NVIDIA users
//! containers without GPUs (#1380). Simulated devices need no nodes: their spec is written at
//! once.
//!
//! One [`NodeSpec`] is shared by the spec keeper (`tasks::keep_node_spec`), the only writer,
//! which syncs it on the blocking pool on inventory changes, on request and, while waiting for
//! device nodes, every second; and the device plugin's Allocate, which only reads what the
//! keeper last published ([`NodeSpec::ready_for`]) before it hands out a CDI name: a name whose
//! spec is not written would make the runtime fail the container, so Allocate fails instead,
//! with the same reason NodePrepare gives ([`DeviceNodesError`]). Allocate never scans, writes
//! or takes the writer's lock on a runtime worker; when the spec is not current it asks the
//! keeper to try again and awaits that attempt, so a later Allocate succeeds once the nodes are
//! right.

use crate::cdi::{self, DeviceNodesError, InstallCache, Kind, WriteError, WriteOutcome};
use crate::inventory::Inventory;
use crate::paths::HostPaths;
use crate::source::DeviceMode;
use gpuplane_model::report::chain;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// File stem of the node spec under the CDI root.
pub const NODE_SPEC_STEM: &str = "gpuplane-node";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecState {
    /// The spec on disk matches the inventory.
    Current,
    /// Device nodes are missing or wrong, or the write failed; try again later.
    Waiting,
}

/// Why the node spec is not written for the current inventory.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NodeSpecError {
    #[error("the node CDI spec `{stem}` is not written: {}", chain(.0), stem = NODE_SPEC_STEM)]
    DeviceNodes(DeviceNodesError),
    #[error("the node CDI spec `{stem}` could not be written: {0}; check the CDI directory", stem = NODE_SPEC_STEM)]
    Write(String),
    #[error("the node CDI spec `{stem}` is not yet written for the current devices (waited {0:?}); retry", stem = NODE_SPEC_STEM)]
    NotYet(Duration),
}

/// What the keeper last published: the inventory it synced the spec for and how that went.
#[derive(Debug, Clone)]
struct Synced {
    /// Counts publications, so a reader can wait for one newer than what it saw.
    seq: u64,
    synced_for: Option<Inventory>,
    outcome: Result<(), NodeSpecError>,
}

struct Writer {
    written_for: Option<Inventory>,
    /// The last refusal, so a long wait is logged once, not every second.
    last_error: Option<String>,
}

/// The node spec writer, shared (see the module docs).
pub struct NodeSpec {
    paths: HostPaths,
    mode: DeviceMode,
    writer: Mutex<Writer>,
    /// While waiting for device nodes the spec is retried every second: scan the driver's
    /// libraries once per driver version, not per retry.
    installs: InstallCache,
    /// The keeper's publications, read by Allocate.
    synced: watch::Sender<Synced>,
    /// Allocate's request that the keeper sync now rather than at its next tick.
    retry: Notify,
}

impl NodeSpec {
    pub fn new(paths: HostPaths, mode: DeviceMode) -> Self {
        NodeSpec {
            paths,
            mode,
            writer: Mutex::new(Writer {
                written_for: None,
                last_error: None,
            }),
            installs: InstallCache::default(),
            synced: watch::Sender::new(Synced {
                seq: 0,
                synced_for: None,
                outcome: Ok(()),
            }),
            retry: Notify::new(),
        }
    }

    /// Whether the node's devices are real or simulated.
    pub fn mode(&self) -> DeviceMode {
        self.mode
    }

    /// The keeper's step (blocking: it may scan, write and fsync): writes the spec for `inv`
    /// unless it is already current, logs why not, and publishes the outcome to Allocate.
    pub fn sync(&self, inv: &Inventory) -> SpecState {
        let outcome = self.ensure(inv);
        let state = match outcome {
            Ok(()) => SpecState::Current,
            Err(_) => SpecState::Waiting,
        };
        self.synced.send_modify(|s| {
            s.seq += 1;
            s.synced_for = Some(inv.clone());
            s.outcome = outcome;
        });
        state
    }

    /// Resolves when Allocate asked the keeper to sync now.
    pub async fn retry_requested(&self) {
        self.retry.notified().await;
    }

    /// Whether the spec on disk is the one for `inv`, from what the keeper published; does no
    /// I/O. When it is not (yet), asks the keeper for a fresh attempt and awaits its outcome
    /// for `inv` up to `patience`.
    pub async fn ready_for(
        &self,
        inv: &Inventory,
        patience: Duration,
    ) -> Result<(), NodeSpecError> {
        let mut rx = self.synced.subscribe();
        let seen = {
            let s = rx.borrow_and_update();
            if s.synced_for.as_ref() == Some(inv) && s.outcome.is_ok() {
                return Ok(());
            }
            s.seq
        };
        self.retry.notify_one();
        let fresh = async {
            while rx.changed().await.is_ok() {
                let s = rx.borrow_and_update();
                if s.seq > seen && s.synced_for.as_ref() == Some(inv) {
                    return Some(s.outcome.clone());
                }
            }
            None
        };
        match tokio::time::timeout(patience, fresh).await {
            Ok(Some(outcome)) => outcome,
            _ => Err(NodeSpecError::NotYet(patience)),
        }
    }

    /// Makes sure the spec on disk is the one for `inv`, writing it if it can; the reason when
    /// it cannot.
    fn ensure(&self, inv: &Inventory) -> Result<(), NodeSpecError> {
        // A poisoned lock only means a panic mid-write; the state is re-derived from disk.
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if w.written_for.as_ref() == Some(inv) {
            return Ok(());
        }
        let result = self.write(inv);
        match &result {
            Ok(()) => {
                w.written_for = Some(inv.clone());
                w.last_error = None;
            }
            Err(e) => {
                let text = e.to_string();
                if w.last_error.as_deref() != Some(text.as_str()) {
                    match e {
                        NodeSpecError::DeviceNodes(_) => {
                            tracing::warn!(error = %text, "waiting for device nodes; the CDI spec is written once they are right")
                        }
                        NodeSpecError::Write(_) | NodeSpecError::NotYet(_) => {
                            tracing::error!(error = %text, "writing the CDI spec failed; retrying")
                        }
                    }
                    w.last_error = Some(text);
                }
            }
        }
        result
    }

    fn write(&self, inv: &Inventory) -> Result<(), NodeSpecError> {
        let kind = Kind::default();
        let spec = match self.mode {
            DeviceMode::Simulated => cdi::render_simulated_node_spec(inv, &kind),
            DeviceMode::Hardware => {
                let files = self.installs.discover(&self.paths, inv);
                files.check_all().map_err(NodeSpecError::DeviceNodes)?;
                cdi::render_node_spec(inv, &files, &kind)
            }
        };
        let outcome = cdi::write_spec(
            &self.paths.cdi_root,
            NODE_SPEC_STEM,
            &spec,
            cdi::Durability::Durable,
        )
        .map_err(|e: WriteError| NodeSpecError::Write(e.to_string()))?;
        if outcome == WriteOutcome::Written {
            tracing::info!(dir = %self.paths.cdi_root.display(), devices = spec.devices.len(), version = %spec.cdi_version, mode = ?self.mode, "CDI spec written");
        }
        Ok(())
    }
}
