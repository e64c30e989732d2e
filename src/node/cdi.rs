//! Keeps the node-wide CDI spec (`nvidia.com/gpu`, the names Allocate hands out) in step with
//! the inventory. A spec is only written once every device node it names exists: a spec cached
//! before the driver created `/dev/nvidia*` gave NVIDIA users containers without GPUs (#1380).

use crate::cdi::{self, DriverFiles, Kind, ProcCaps, WriteOutcome};
use crate::inventory::Inventory;
use std::path::{Path, PathBuf};

/// File stem of the node spec under the CDI root.
pub const NODE_SPEC_STEM: &str = "gpuplane-node";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecState {
    /// The spec on disk matches the inventory.
    Current,
    /// Device nodes are missing; try again later.
    Waiting,
}

pub struct NodeSpecWriter {
    cdi_root: PathBuf,
    driver_root: PathBuf,
    driver_root_mount: Option<PathBuf>,
    dev_root: PathBuf,
    written_for: Option<Inventory>,
    missing_logged: bool,
}

impl NodeSpecWriter {
    pub fn new(
        cdi_root: PathBuf,
        driver_root: PathBuf,
        driver_root_mount: Option<PathBuf>,
        dev_root: PathBuf,
    ) -> Self {
        NodeSpecWriter {
            cdi_root,
            driver_root,
            driver_root_mount,
            dev_root,
            written_for: None,
            missing_logged: false,
        }
    }

    /// Writes the spec for `inv` unless it is already current.
    pub fn sync(&mut self, inv: &Inventory) -> SpecState {
        if self.written_for.as_ref() == Some(inv) {
            return SpecState::Current;
        }
        let caps = ProcCaps::new(Path::new("/proc"));
        let files = DriverFiles::discover_mounted(
            &self.driver_root,
            self.driver_root_mount.as_deref(),
            &self.dev_root,
            inv,
            &|c| caps.minor(c),
        );
        if !files.is_complete() {
            if !self.missing_logged {
                let missing: Vec<String> = files
                    .missing_device_nodes
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect();
                tracing::warn!(missing = %missing.join(", "), "device nodes missing; the CDI spec is written once they exist");
                self.missing_logged = true;
            }
            return SpecState::Waiting;
        }
        self.missing_logged = false;
        let spec = cdi::render_node_spec(inv, &files, &Kind::default());
        match cdi::write_spec(&self.cdi_root, NODE_SPEC_STEM, &spec) {
            Ok(outcome) => {
                if outcome == WriteOutcome::Written {
                    tracing::info!(dir = %self.cdi_root.display(), devices = spec.devices.len(), version = %spec.cdi_version, "CDI spec written");
                }
                self.written_for = Some(inv.clone());
                SpecState::Current
            }
            Err(e) => {
                tracing::error!(error = %e, "writing the CDI spec failed; retrying");
                SpecState::Waiting
            }
        }
    }
}
