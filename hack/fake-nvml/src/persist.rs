//! The state file (`GPUPLANE_FAKE_NVML_STATE`): the MIG instances as the last change left them,
//! so they outlive the process that made them, as instances in a real driver outlive the agent
//! that created them (a crash test restarts the agent and expects its instances still there).
//!
//! JSON: `{"gpus": [{"uuid": "GPU-…", "migDevices": [<MigDevice>…], "book": <InstanceBook>}]}`,
//! one entry per GPU of the profile; the MIG devices replace those the profile lists and the
//! book carries bare GPU instances and the creation count (`sim::instances`). Read when a
//! process builds its machine (the first `nvmlInit_v2`); written after every change, whole,
//! through a temporary file and a rename, so a process killed mid-write leaves the old state.
//! Processes do not see each other's changes until their next initialisation.

use gpuplane_model::inventory::{Inventory, MigDevice};
use gpuplane_model::sim::instances::InstanceBook;
use serde_json::{json, Value};
use std::path::Path;

/// Applies the state file at `path`, if there is one, to the machine built from the profile.
pub(crate) fn load(
    path: &Path,
    inventory: &mut Inventory,
    books: &mut [InstanceBook],
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
        inventory.gpus[index].mig_devices = devices;
        books[index] = book;
    }
    Ok(())
}

/// Writes the machine's MIG instances to `path`.
pub(crate) fn save(
    path: &Path,
    inventory: &Inventory,
    books: &[InstanceBook],
) -> Result<(), String> {
    let gpus: Vec<Value> = inventory
        .gpus
        .iter()
        .zip(books)
        .map(|(g, book)| json!({"uuid": g.uuid, "migDevices": g.mig_devices, "book": book}))
        .collect();
    let text = serde_json::to_string_pretty(&json!({ "gpus": gpus }))
        .map_err(|e| format!("state file {}: {e}", path.display()))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            format!(
                "cannot write state file {}: {e}; MIG changes will not outlive this process",
                path.display()
            )
        })
}
