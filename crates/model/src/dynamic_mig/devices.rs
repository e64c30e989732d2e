//! The partitionable devices of dynamic-MIG GPUs: one per (profile, allowed start) of the GPU's
//! table and one for the whole GPU, their names, what preparing each creates, and the counters
//! they consume.
//!
//! **Counters** (one counter set per GPU, [`counter_set_name`]): `memory-slice-<k>` = 1 for
//! each memory slice, `compute-slices` = the table's compute slices, and one counter per engine
//! kind the full profile has ([`ENGINE_COUNTERS`]). An instance consumes its memory slices
//! `[start, start + size)`, its compute slices and its engines; the whole GPU consumes
//! everything. A set of devices fits these counters exactly when repeated
//! [`MigCatalogue::admit`] accepts it (tested for every table): the memory-slice counters are
//! admit's overlap rule, the others its sums, and the allowed starts are which devices exist.

use super::table_of;
use crate::inventory::mig::{EngineCount, MigCatalogue, MigProfileSpec};
use crate::inventory::{profile_label, Gpu, Inventory, Placement};
use crate::source::MigRequest;
use std::collections::BTreeMap;

/// The counter of the GPU's compute slices.
pub const COMPUTE_SLICES_COUNTER: &str = "compute-slices";

/// The engine counters, by name: a GPU's counter set has those its full profile counts.
pub const ENGINE_COUNTERS: [(&str, EngineCount); 5] = [
    ("copy-engines", |p| p.copy_engines),
    ("decoders", |p| p.decoders),
    ("encoders", |p| p.encoders),
    ("jpeg-engines", |p| p.jpeg_engines),
    ("ofa-engines", |p| p.ofa_engines),
];

fn memory_slice_counter(k: u32) -> String {
    format!("memory-slice-{k}")
}

/// What a dynamic device stands for on its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The whole GPU: preparing it creates the table's full-profile instance.
    Whole,
    /// An instance of `profile` starting at memory slice `start`.
    Instance {
        profile: &'static MigProfileSpec,
        start: u32,
    },
}

/// One partitionable device of a dynamic-MIG GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DynamicDevice<'a> {
    pub parent: &'a Gpu,
    pub table: &'static MigCatalogue,
    pub slot: Slot,
}

/// Every dynamic device of `inv`: those of each GPU marked dynamic, in inventory order.
pub fn devices(inv: &Inventory) -> Vec<DynamicDevice<'_>> {
    inv.gpus
        .iter()
        .filter(|g| g.mig.dynamic)
        .filter_map(|g| table_of(g).map(|t| gpu_devices(g, t)))
        .flatten()
        .collect()
}

/// One GPU's dynamic devices: the whole GPU, then each profile of `table` in table order at
/// each of its allowed starts, lowest first.
pub fn gpu_devices<'a>(parent: &'a Gpu, table: &'static MigCatalogue) -> Vec<DynamicDevice<'a>> {
    let whole = DynamicDevice {
        parent,
        table,
        slot: Slot::Whole,
    };
    let instances = table.profiles.iter().flat_map(|profile| {
        profile.placements.iter().map(move |&start| DynamicDevice {
            parent,
            table,
            slot: Slot::Instance { profile, start },
        })
    });
    std::iter::once(whole).chain(instances).collect()
}

/// The dynamic device named `name` ([`DynamicDevice::dra_name`]), if `inv` has it.
pub fn device<'a>(inv: &'a Inventory, name: &str) -> Option<DynamicDevice<'a>> {
    let rest = name.strip_prefix("gpu-")?;
    let digits = rest.split('-').next()?;
    // Only canonical indices: `gpu-01` is not `gpu-1`.
    if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
        return None;
    }
    let g = inv.gpu(digits.parse().ok()?)?;
    if !g.mig.dynamic {
        return None;
    }
    gpu_devices(g, table_of(g)?)
        .into_iter()
        .find(|d| d.dra_name() == name)
}

/// The name of a GPU's counter set in the pool: `gpu-<index>`.
pub fn counter_set_name(gpu: &Gpu) -> String {
    format!("gpu-{}", gpu.index)
}

/// A GPU's counters under `table`, by name (all DNS labels).
pub fn counters(table: &MigCatalogue) -> BTreeMap<String, u32> {
    let mut out: BTreeMap<String, u32> = (0..table.memory_slices)
        .map(|k| (memory_slice_counter(k), 1))
        .collect();
    out.insert(COMPUTE_SLICES_COUNTER.to_string(), table.compute_slices);
    if let Some(full) = table.full_profile() {
        for (name, count) in ENGINE_COUNTERS {
            if count(full) > 0 {
                out.insert(name.to_string(), count(full));
            }
        }
    }
    out
}

impl DynamicDevice<'_> {
    /// `gpu-<index>` for the whole GPU (as a GPU without MIG is named), and
    /// `gpu-<index>-mig-<profile letters and digits>-at<start>` for an instance, e.g.
    /// `gpu-0-mig-1g10gbme-at3`: never a static MIG device's `gpu-<i>-mig-<p>-<gi>[-<ci>]`.
    pub fn dra_name(&self) -> String {
        match self.slot {
            Slot::Whole => format!("gpu-{}", self.parent.index),
            Slot::Instance { profile, start } => format!(
                "gpu-{}-mig-{}-at{start}",
                self.parent.index,
                profile_label(profile.name)
            ),
        }
    }

    /// The profile preparing this device creates: the full profile for the whole GPU.
    pub fn profile(&self) -> Option<&'static MigProfileSpec> {
        match self.slot {
            Slot::Whole => self.table.full_profile(),
            Slot::Instance { profile, .. } => Some(profile),
        }
    }

    /// The memory slices the device's instance covers.
    pub fn placement(&self) -> Placement {
        match self.slot {
            Slot::Whole => Placement {
                start: 0,
                size: self.table.memory_slices,
            },
            Slot::Instance { profile, start } => Placement {
                start,
                size: profile.memory_slices,
            },
        }
    }

    /// The instance preparing this device creates (the whole GPU: the full profile at 0).
    pub fn to_request(&self) -> MigRequest {
        MigRequest {
            gpu: self.parent.uuid.clone(),
            // `table_of` only admits tables with a full profile, so this is never empty.
            profile: self
                .profile()
                .map_or_else(String::new, |p| p.name.to_string()),
            start: self.placement().start,
        }
    }

    /// What the device consumes from its GPU's counter set, by counter name; no zero entries.
    pub fn consumes(&self) -> BTreeMap<String, u32> {
        let Slot::Instance { profile, start } = self.slot else {
            return counters(self.table);
        };
        let mut out: BTreeMap<String, u32> = (start..start + profile.memory_slices)
            .map(|k| (memory_slice_counter(k), 1))
            .collect();
        out.insert(COMPUTE_SLICES_COUNTER.to_string(), profile.gpu_slices);
        let available = counters(self.table);
        for (name, count) in ENGINE_COUNTERS {
            // A kind the GPU lacks has no counter; no bundled profile uses one (tested).
            if count(profile) > 0 && available.contains_key(name) {
                out.insert(name.to_string(), count(profile));
            }
        }
        out.retain(|_, v| *v > 0);
        out
    }
}

#[cfg(test)]
mod tests;
