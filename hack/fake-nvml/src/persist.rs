//! The state file (`GPUPLANE_FAKE_NVML_STATE`): the MIG instances, compute modes and cgroup
//! memory limits as the last change left them, so they outlive the process that made them, as
//! instances and compute modes in a real driver outlive the agent that set them (a crash test
//! restarts the agent and expects its instances still there; a restarted agent finds the GPUs
//! of its MPS daemons still in `EXCLUSIVE_PROCESS`).
//!
//! JSON: `{"gpus": [{"uuid": "GPU-…", "migDevices": [<MigDevice>…], "book": <InstanceBook>,
//! "computeMode": <ComputeMode>}]}`, one entry per GPU of the profile; the MIG devices replace
//! those the profile lists, the book carries bare GPU instances and the creation count
//! (`sim::instances`), and the compute mode is nvidia-smi's word (`"Default"`,
//! `"Exclusive_Process"`, `"Prohibited"`; absent, as in files written before it was kept, means
//! `"Default"`). Beside `gpus`, `"memoryLimits": [{"uuid": "GPU-…", "cgroup": "/sys/…",
//! "inode": <n>, "softLimit": <bytes>, "hardLimit": <bytes>}…]` (absent: none), in
//! `memory_limits.rs`'s format, which the fake MPS daemon reads too. Read when a process builds
//! its machine (the first `nvmlInit_v2`); written after every change, whole, through a
//! temporary file and a rename, so a process killed mid-write leaves the old state. Processes
//! do not see each other's changes until their next initialisation.

use crate::memory_limits::{self, MemoryLimit};
use gpuplane_model::inventory::{Inventory, MigDevice};
use gpuplane_model::sim::instances::InstanceBook;
use gpuplane_model::source::ComputeMode;
use serde_json::{json, Value};
use std::path::Path;

/// Applies the state file at `path`, if there is one, to the machine built from the profile:
/// its MIG devices, its instance books and its compute modes (all per GPU index), and the
/// memory limits (per GPU UUID).
pub(crate) fn load(
    path: &Path,
    inventory: &mut Inventory,
    books: &mut [InstanceBook],
    modes: &mut [ComputeMode],
    limits: &mut Vec<MemoryLimit>,
) -> Result<(), String> {
    let fail = |why: String| {
        format!(
            "fake NVML: state file {}: {why}; delete it to start again from the profile",
            path.display()
        )
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(fail(e.to_string())),
    };
    let value: Value = serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
    let gpus = value["gpus"]
        .as_array()
        .ok_or_else(|| fail("no `gpus` list".into()))?;
    for entry in gpus {
        let uuid = entry["uuid"]
            .as_str()
            .ok_or_else(|| fail("a `gpus` entry without `uuid`".into()))?;
        let index = inventory
            .gpus
            .iter()
            .position(|g| g.uuid == uuid)
            .ok_or_else(|| fail(format!("GPU {uuid} is not in the profile")))?;
        let devices: Vec<MigDevice> = serde_json::from_value(entry["migDevices"].clone())
            .map_err(|e| fail(format!("GPU {uuid}: migDevices: {e}")))?;
        let book: InstanceBook = serde_json::from_value(entry["book"].clone())
            .map_err(|e| fail(format!("GPU {uuid}: book: {e}")))?;
        let mode = match entry.get("computeMode") {
            None => ComputeMode::Default,
            Some(m) => serde_json::from_value(m.clone())
                .map_err(|e| fail(format!("GPU {uuid}: computeMode: {e}")))?,
        };
        inventory.gpus[index].mig_devices = devices;
        books[index] = book;
        modes[index] = mode;
    }
    *limits = memory_limits::from_state(&value).map_err(fail)?;
    if let Some(l) = limits
        .iter()
        .find(|l| !inventory.gpus.iter().any(|g| g.uuid == l.uuid))
    {
        return Err(fail(format!(
            "memoryLimits: GPU {} is not in the profile",
            l.uuid
        )));
    }
    Ok(())
}

/// Writes the machine's MIG instances, compute modes and memory limits to `path`.
pub(crate) fn save(
    path: &Path,
    inventory: &Inventory,
    books: &[InstanceBook],
    modes: &[ComputeMode],
    limits: &[MemoryLimit],
) -> Result<(), String> {
    let gpus: Vec<Value> = inventory
        .gpus
        .iter()
        .zip(books)
        .zip(modes)
        .map(|((g, book), mode)| {
            json!({"uuid": g.uuid, "migDevices": g.mig_devices, "book": book, "computeMode": mode})
        })
        .collect();
    let limits = memory_limits::to_state(limits);
    write_whole(path, &json!({ "gpus": gpus, "memoryLimits": limits })).map_err(|e| {
        format!("{e}; MIG, compute-mode and memory-limit changes will not outlive this process")
    })
}

/// Writes `value` to `path` through a temporary file and a rename, so that a process killed
/// mid-write leaves the old state.
pub(crate) fn write_whole(path: &Path, value: &Value) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| format!("state file {}: {e}", path.display()))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| format!("cannot write state file {}: {e}", path.display()))
}
