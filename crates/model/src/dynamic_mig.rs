//! Dynamic MIG (pure): which GPUs gpuplane partitions on demand, and the partitionable devices
//! (KEP-4815) they are published as.
//!
//! A GPU takes part when the `dynamicMig` config section selects it, it is in MIG mode with no
//! change pending, a bundled MIG table ([`crate::inventory::mig`]) describes it, and every MIG
//! instance on it is one gpuplane created. Such a GPU is published as every instance the table
//! allows (each profile at each allowed start) plus the whole GPU, all consuming one counter
//! set per GPU ([`devices`]), so the scheduler only allocates combinations the hardware can
//! create; NodePrepare then creates the instance. Any other selected GPU is published as
//! before (whole, or its existing MIG devices) with a [`NotDynamic`] reason saying what to do.
//! gpuplane never changes MIG mode, resets a GPU or touches an instance it did not create.

mod devices;

pub use devices::{
    counter_set_name, counters, device, devices, gpu_devices, DynamicDevice, Slot,
    COMPUTE_SLICES_COUNTER, ENGINE_COUNTERS,
};

use crate::gpu_select::{GpuSelect, InvalidField};
use crate::inventory::mig::{self, MigCatalogue};
use crate::inventory::{DeviceRef, Gpu, Inventory, MigDevice};
use serde::Deserialize;
use std::fmt;

/// The config section's name, as errors spell it.
pub const SECTION: &str = "dynamicMig";

/// The validated `dynamicMig` section: which GPUs gpuplane may partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamicMigConfig {
    pub select: GpuSelect,
}

/// The raw `dynamicMig` section of the agent config.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct RawDynamicMig {
    #[serde(default)]
    gpus: Option<serde_yaml_ng::Value>,
    #[serde(default)]
    models: Option<Vec<String>>,
}

impl RawDynamicMig {
    /// Validates the section; errors name `dynamicMig.gpus` or `dynamicMig.models`.
    pub(crate) fn validate(self) -> Result<DynamicMigConfig, InvalidField> {
        let select = GpuSelect::parse(
            SECTION,
            self.gpus,
            self.models,
            "remove the section to partition no GPU dynamically",
        )?;
        Ok(DynamicMigConfig { select })
    }
}

/// The bundled table a GPU's source matched ([`crate::inventory::MigMode::table`]), if it has
/// the full profile every counter set is measured against.
pub fn table_of(g: &Gpu) -> Option<&'static MigCatalogue> {
    g.mig
        .table
        .as_deref()
        .and_then(mig::catalogue)
        .filter(|t| t.full_profile().is_some())
}

/// Which selected GPUs take part in dynamic MIG, and why the others do not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Participation {
    /// The GPUs that take part, in inventory order.
    pub gpus: Vec<Participant>,
    /// Selected GPUs that do not, by index.
    pub refused: Vec<Refusal>,
}

/// A GPU that takes part, with the table its devices come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Participant {
    pub index: u32,
    pub table: &'static MigCatalogue,
}

/// A selected GPU that does not take part, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub index: u32,
    pub reason: NotDynamic,
}

impl Participation {
    pub fn takes_part(&self, index: u32) -> bool {
        self.gpus.iter().any(|p| p.index == index)
    }
}

/// A MIG instance gpuplane did not create, as the reason lists it: `profile@start (GI id)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignInstance {
    pub profile: String,
    pub start: u32,
    pub gpu_instance_id: u32,
}

impl fmt::Display for ForeignInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{} (GI {})",
            self.profile, self.start, self.gpu_instance_id
        )
    }
}

/// Why a GPU `dynamicMig` selects is not partitioned dynamically. Each says what the GPU is
/// published as instead and what an administrator can do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotDynamic {
    #[error(
        "dynamicMig.gpus names GPU {index}, which this node does not have; remove it from the list"
    )]
    NoSuchGpu { index: u32 },
    #[error("GPU {index} ({product}) cannot do MIG; it is published whole, as without dynamicMig")]
    NotCapable { index: u32, product: String },
    #[error("GPU {index} has MIG mode off: turn it on with `nvidia-smi -i {index} -mig 1` and reset the GPU (`nvidia-smi -i {index} -r`, or reboot the node); gpuplane never changes MIG mode or resets a GPU. Until then it is published whole")]
    MigOff { index: u32 },
    #[error("GPU {index} turns MIG mode on at its next reset, which has not happened: reset it (`nvidia-smi -i {index} -r`, or reboot the node); gpuplane never resets a GPU. Until then it is published whole")]
    EnablePending { index: u32 },
    #[error("GPU {index} turns MIG mode off at its next reset (`nvidia-smi -i {index} -mig 0` was run): gpuplane does not partition a GPU about to leave MIG mode; run `nvidia-smi -i {index} -mig 1` to keep it. Until then its MIG devices are published as they are")]
    DisablePending { index: u32 },
    #[error("GPU {index} ({product}) has no bundled MIG table (gpuplane knows {known}), so gpuplane cannot tell where its instances may go; its MIG devices are published as they are")]
    NoTable {
        index: u32,
        product: String,
        known: String,
    },
    #[error("GPU {index} has MIG instances gpuplane did not create: {}; gpuplane never touches them. Destroy them (`nvidia-smi mig -i {index} -dci`, then `-dgi`) for gpuplane to partition this GPU; until then they are published as they are", list(.instances))]
    ForeignInstances {
        index: u32,
        instances: Vec<ForeignInstance>,
    },
}

fn list(instances: &[ForeignInstance]) -> String {
    instances
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Which GPUs of `inv` that `cfg` selects take part in dynamic MIG. `owned` tells which MIG
/// instances gpuplane created (the agent's record); any other instance keeps its GPU out.
pub fn plan(
    inv: &Inventory,
    cfg: &DynamicMigConfig,
    owned: &dyn Fn(&Gpu, &MigDevice) -> bool,
) -> Participation {
    let mut p = Participation::default();
    if let GpuSelect::Indices(wanted) = &cfg.select {
        for &index in wanted.iter().filter(|i| inv.gpu(**i).is_none()) {
            p.refused.push(Refusal {
                index,
                reason: NotDynamic::NoSuchGpu { index },
            });
        }
    }
    for g in inv.gpus.iter().filter(|g| cfg.select.selects(g)) {
        match check(g, owned) {
            Ok(table) => p.gpus.push(Participant {
                index: g.index,
                table,
            }),
            Err(reason) => p.refused.push(Refusal {
                index: g.index,
                reason,
            }),
        }
    }
    p.refused.sort_by_key(|r| r.index);
    p
}

/// Whether one selected GPU can take part, in the order an administrator fixes things.
fn check(
    g: &Gpu,
    owned: &dyn Fn(&Gpu, &MigDevice) -> bool,
) -> Result<&'static MigCatalogue, NotDynamic> {
    let index = g.index;
    let m = &g.mig;
    if !m.capable {
        return Err(NotDynamic::NotCapable {
            index,
            product: g.product_name.clone(),
        });
    }
    match (m.current, m.pending) {
        (false, true) => return Err(NotDynamic::EnablePending { index }),
        (false, false) => return Err(NotDynamic::MigOff { index }),
        (true, false) => return Err(NotDynamic::DisablePending { index }),
        (true, true) => {}
    }
    let table = table_of(g).ok_or_else(|| NotDynamic::NoTable {
        index,
        product: g.product_name.clone(),
        known: mig::catalogue_names().join(", "),
    })?;
    let mut foreign: Vec<ForeignInstance> = Vec::new();
    for d in g.mig_devices.iter().filter(|d| !owned(g, d)) {
        // One entry per GPU instance, however many compute instances it has.
        if !foreign
            .iter()
            .any(|f| f.gpu_instance_id == d.gpu_instance_id)
        {
            foreign.push(ForeignInstance {
                profile: d.profile.to_string(),
                start: d.placement.start,
                gpu_instance_id: d.gpu_instance_id,
            });
        }
    }
    if foreign.is_empty() {
        Ok(table)
    } else {
        Err(NotDynamic::ForeignInstances {
            index,
            instances: foreign,
        })
    }
}

/// Marks the GPUs that take part (`mig.dynamic`), and only those, so the inventory's DRA
/// devices, the device plugin's view and the slices leave them to this module.
pub fn mark(inv: &mut Inventory, p: &Participation) {
    for g in &mut inv.gpus {
        g.mig.dynamic = p.takes_part(g.index);
    }
}

// Here rather than beside `Inventory::dra_devices`: resolving a name needs the dynamic devices,
// and the inventory sits below this module.
impl Inventory {
    /// The DRA device with this name; for a dynamic MIG device, its instance once it exists
    /// (placements never overlap, so at most one instance sits at the device's profile and
    /// start): a prepared dynamic device is then planned, specified and held as that MIG device.
    pub fn dra_device(&self, name: &str) -> Option<DeviceRef<'_>> {
        self.dra_devices()
            .into_iter()
            .find(|d| d.dra_name() == name)
            .or_else(|| {
                let d = device(self, name)?;
                let request = d.to_request();
                let mig = d.parent.mig_devices.iter().find(|m| {
                    m.placement.start == request.start && m.profile.as_str() == request.profile
                })?;
                Some(DeviceRef::Mig {
                    parent: d.parent,
                    mig,
                })
            })
    }
}

#[cfg(test)]
mod tests;
