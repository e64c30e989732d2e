//! A GPU's compute mode while its MPS daemon serves it: `EXCLUSIVE_PROCESS`, so the MPS server
//! is the one process with a context on the GPU and a share container that drops its
//! `CUDA_MPS_PIPE_DIRECTORY` cannot reach the GPU around MPS (NVIDIA's MPS documentation,
//! "Architecture" and "Tools and Interface Reference": the GPU in `EXCLUSIVE_PROCESS` so that
//! only the MPS server uses it; NVIDIA's DRA driver sets it before it starts a daemon and back
//! to `DEFAULT` after, cmd/gpu-kubelet-plugin/sharing.go). The mode the GPU had is recorded in
//! the unit's directory before the change and put back from that record: a kill between the two
//! leaves the record, for the next instance (which keeps it) or the agent (which restores from
//! it before it removes the directory). A MIG device has no compute mode of its own to set:
//! its GPU's is left alone.

use crate::inventory::DeviceUuid;
use crate::source::{ComputeMode, ComputeModeError, DeviceSource};
use std::path::Path;
use tracing::info;

/// The record's file name in the unit's directory.
pub const RECORD: &str = "compute-mode.json";

#[derive(Debug, thiserror::Error)]
pub enum ModeError {
    #[error("GPU {gpu}: {cause}")]
    Nvml {
        gpu: String,
        cause: ComputeModeError,
    },
    #[error("the compute mode record {path}: {cause}")]
    Record { path: String, cause: String },
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    gpu: DeviceUuid,
    previous: ComputeMode,
}

/// Whether `unit` is a whole GPU (MIG device UUIDs start `MIG-`).
pub fn applies_to(unit: &str) -> bool {
    unit.starts_with("GPU-")
}

/// Puts `gpu` in `EXCLUSIVE_PROCESS`, recording the mode it had first (unless a record from an
/// earlier instance is there: that one holds the mode to go back to).
pub fn make_exclusive(
    source: &dyn DeviceSource,
    gpu: &DeviceUuid,
    dir: &Path,
) -> Result<(), ModeError> {
    let path = dir.join(RECORD);
    let nvml = |cause| ModeError::Nvml {
        gpu: gpu.to_string(),
        cause,
    };
    if !path.exists() {
        let previous = source.compute_mode(gpu).map_err(nvml)?;
        let record = Record {
            gpu: gpu.clone(),
            previous,
        };
        let bytes = serde_json::to_vec(&record).map_err(|e| ModeError::Record {
            path: path.display().to_string(),
            cause: e.to_string(),
        })?;
        crate::fsutil::write_atomic(&path, &bytes, 0o644).map_err(|e| ModeError::Record {
            path: path.display().to_string(),
            cause: e.to_string(),
        })?;
    }
    source
        .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)
        .map_err(nvml)?;
    info!(gpu = %gpu, "GPU in compute mode Exclusive_Process while MPS serves it");
    Ok(())
}

/// Puts the GPU of `dir`'s record back in the mode it had and removes the record; false when
/// there is no record (nothing was changed).
pub fn restore(source: &dyn DeviceSource, dir: &Path) -> Result<bool, ModeError> {
    let path = dir.join(RECORD);
    let record_error = |cause: String| ModeError::Record {
        path: path.display().to_string(),
        cause,
    };
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(record_error(e.to_string())),
    };
    let record: Record = serde_json::from_slice(&bytes).map_err(|e| record_error(e.to_string()))?;
    source
        .set_compute_mode(&record.gpu, record.previous)
        .map_err(|cause| ModeError::Nvml {
            gpu: record.gpu.to_string(),
            cause,
        })?;
    crate::fsutil::remove_durable(&path).map_err(|e| record_error(e.to_string()))?;
    info!(gpu = %record.gpu, mode = %record.previous, "GPU back in its compute mode");
    Ok(true)
}
