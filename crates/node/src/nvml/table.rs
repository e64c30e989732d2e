//! Which bundled MIG table ([`mig::catalogue`]) a GPU follows: the one its product name leads
//! to, and only if NVML's GPU-instance profiles are exactly that table's (names, profile ids,
//! slices, engines and possible placements). Dynamic MIG places instances by the table's rule
//! (`MigCatalogue::admit`), so a GPU whose driver offers anything else (another memory size,
//! profiles a newer driver added) gets no table, and so no dynamic MIG, rather than a rule that
//! is wrong for it. Read-only: profile info and possible placements, both answered whether or
//! not MIG is on.

use super::call::{self, describe};
use super::naming;
use super::raw;
use crate::inventory::mig::{self, MigCatalogue, ENGINES};
use nvml_wrapper::struct_wrappers::device::ProfileInfo;
use nvml_wrapper::{Device, Nvml};

/// The name of the bundled table GPU `index` matches, or `None` (logged at debug: why).
pub(super) fn matching(
    nvml: &Nvml,
    device: &Device<'_>,
    index: u32,
    product: &str,
    total_bytes: u64,
) -> Option<String> {
    let Some(table) = mig::catalogue_for_product(product) else {
        tracing::debug!(
            gpu = index,
            product,
            "no bundled MIG table for this product"
        );
        return None;
    };
    let why = match call::instance_profiles(device) {
        Ok(profiles) => difference(nvml, device, table, &profiles, total_bytes),
        Err(e) => Some(e.to_string()),
    };
    match why {
        None => Some(table.name.to_string()),
        Some(why) => {
            tracing::debug!(
                gpu = index,
                table = table.name,
                %why,
                "NVML's MIG profiles are not the bundled table's; no table for this GPU"
            );
            None
        }
    }
}

/// The first way NVML's profiles differ from `table`'s, if any.
fn difference(
    nvml: &Nvml,
    device: &Device<'_>,
    table: &MigCatalogue,
    profiles: &[(u32, ProfileInfo)],
    total_bytes: u64,
) -> Option<String> {
    if profiles.len() != table.profiles.len() {
        return Some(format!(
            "NVML offers {} GPU-instance profiles, the table {}",
            profiles.len(),
            table.profiles.len()
        ));
    }
    for spec in table.profiles {
        let Some((_, info)) = profiles.iter().find(|(i, _)| *i == spec.nvml_profile) else {
            return Some(format!(
                "NVML has no profile index {} ({})",
                spec.nvml_profile, spec.name
            ));
        };
        let name = naming::mig_profile_name(
            spec.nvml_profile,
            info.slice_count,
            0,
            info.memory_size_mb,
            total_bytes,
        );
        let engines = [
            info.copy_engine_count,
            info.decoder_count,
            info.encoder_count,
            info.jpeg_count,
            info.ofa_count,
        ];
        let same_engines = ENGINES
            .iter()
            .zip(engines)
            .all(|((_, count), nvml)| count(spec) == nvml);
        if name != spec.name
            || info.id != spec.id
            || info.slice_count != spec.gpu_slices
            || !same_engines
        {
            return Some(format!(
                "profile index {} is {name} (id {}, {} slices, engines {engines:?}), the table's {}",
                spec.nvml_profile, info.id, info.slice_count, spec.name
            ));
        }
        let placements = match raw::possible_placements(nvml, device, info.id) {
            Ok(p) => p,
            Err(e) => {
                return Some(format!(
                    "nvmlDeviceGetGpuInstancePossiblePlacements_v2 for {name}: {}",
                    describe(&e)
                ))
            }
        };
        let starts: Vec<u32> = placements.iter().map(|p| p.start).collect();
        if starts != spec.placements || placements.iter().any(|p| p.size != spec.memory_slices) {
            return Some(format!(
                "{name} may start at {starts:?}, the table says {:?}",
                spec.placements
            ));
        }
    }
    None
}
