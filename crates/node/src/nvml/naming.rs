//! How NVML's raw answers become the strings the inventory uses: MIG profile names, PCI bus ids
//! and the CUDA driver version. Pure functions, tested against the bundled MIG tables.

use nvml_wrapper_sys::bindings::{
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX,
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
    NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME, NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX,
    NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME, NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1,
    NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX,
};

const MIB: u128 = 1 << 20;
const GIB: u128 = 1 << 30;

/// The `<GB>` of a MIG profile name, as NVIDIA's go-nvlib computes it: the profile's share of the
/// GPU's memory rounded *up* to whole eighths, times the GPU's memory in GiB rounded up, rounded
/// to the nearest integer (halves away from zero). Integer arithmetic, so no float surprises.
pub(super) fn mig_memory_gb(profile_mib: u64, total_bytes: u64) -> u64 {
    if total_bytes == 0 {
        return 0;
    }
    let total = u128::from(total_bytes);
    let eighths = (u128::from(profile_mib) * MIB * 8).div_ceil(total);
    let total_gb = total.div_ceil(GIB);
    // round(eighths / 8 * total_gb) == floor((2 * eighths * total_gb + 8) / 16)
    let gb = (2 * eighths * total_gb + 8) / 16;
    u64::try_from(gb).unwrap_or(u64::MAX)
}

/// The attribute suffix NVIDIA appends for a GPU-instance profile index (`NVML_GPU_INSTANCE_PROFILE_*`).
fn profile_suffix(profile_index: u32) -> &'static str {
    match profile_index {
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 | NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 => "+me",
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME | NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME => {
            "+me.all"
        }
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX
        | NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX
        | NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX => "+gfx",
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME | NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME => "-me",
        _ => "",
    }
}

/// A MIG device's profile name: `[<ci>c.]<gi>g.<GB>gb[+attr]`, e.g. `1g.10gb+me`, `1c.3g.40gb`.
/// `ci_slices` below `gi_slices` (and non-zero) means the compute instance covers only part of
/// its GPU instance.
pub(super) fn mig_profile_name(
    profile_index: u32,
    gi_slices: u32,
    ci_slices: u32,
    profile_memory_mib: u64,
    total_bytes: u64,
) -> String {
    let gb = mig_memory_gb(profile_memory_mib, total_bytes);
    let suffix = profile_suffix(profile_index);
    if ci_slices > 0 && ci_slices < gi_slices {
        format!("{ci_slices}c.{gi_slices}g.{gb}gb{suffix}")
    } else {
        format!("{gi_slices}g.{gb}gb{suffix}")
    }
}

fn hex(part: &str, max_digits: usize) -> Option<u64> {
    if part.is_empty() || part.len() > max_digits || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(part, 16).ok()
}

/// A PCI address in NVML's form `DDDDDDDD:BB:DD.F` (upper-case hex, 8-digit domain), from any of
/// the forms drivers print: 4-, 8- or 16-digit domain, either case, or no domain at all.
pub(super) fn normalize_bus_id(raw: &str) -> Option<String> {
    let raw = raw.trim_end_matches('\0').trim();
    let parts: Vec<&str> = raw.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [domain, bus, devfn] => (hex(domain, 16)?, *bus, *devfn),
        [bus, devfn] => (0, *bus, *devfn),
        _ => return None,
    };
    let (dev, func) = devfn.split_once('.')?;
    let (bus, dev, func) = (hex(bus, 2)?, hex(dev, 2)?, hex(func, 1)?);
    if dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:08X}:{bus:02X}:{dev:02X}.{func:X}"))
}

/// `nvmlSystemGetCudaDriverVersion` (e.g. `12040`) as `major.minor` (`12.4`).
pub(super) fn cuda_version(version: i32) -> String {
    format!(
        "{}.{}",
        nvml_wrapper::cuda_driver_version_major(version),
        nvml_wrapper::cuda_driver_version_minor(version)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::mig;
    use crate::sim::{self, ProfileFile};
    use std::collections::BTreeSet;

    #[test]
    fn every_bundled_mig_profile_name_is_reproduced_from_its_memory_and_the_gpu_total() {
        let mut covered = BTreeSet::new();
        for name in sim::bundled_names() {
            let text = sim::bundled_text(name).unwrap();
            let file: ProfileFile = serde_yaml_ng::from_str(text).unwrap();
            for model in file.models.values() {
                let Some(table) = model.mig_catalogue.as_deref() else {
                    continue;
                };
                let catalogue = mig::catalogue(table).unwrap();
                let total_bytes = model.memory_mib << 20;
                for spec in catalogue.profiles {
                    let got = mig_profile_name(
                        spec.nvml_profile,
                        spec.gpu_slices,
                        spec.gpu_slices,
                        spec.memory_mib,
                        total_bytes,
                    );
                    assert_eq!(
                        got, spec.name,
                        "{name}: {table} with {} MiB",
                        model.memory_mib
                    );
                }
                covered.insert(catalogue.name);
            }
        }
        let all: BTreeSet<&str> = mig::catalogue_names().into_iter().collect();
        assert_eq!(
            covered, all,
            "every MIG table is used by some bundled model"
        );
    }

    #[test]
    fn memory_rounds_up_to_eighths_of_the_gpu_then_to_whole_gigabytes() {
        // H100 80GB HBM3 reports 81559 MiB; its 1-slice profile has 9984 MiB.
        assert_eq!(mig_memory_gb(9984, 81559 << 20), 10);
        assert_eq!(mig_memory_gb(81152, 81559 << 20), 80);
        // A 24 GiB part (A30): a quarter is 6 GB.
        assert_eq!(mig_memory_gb(5836, 24 << 30), 6);
        assert_eq!(mig_memory_gb(1, 0), 0);
    }

    #[test]
    fn a_compute_instance_smaller_than_its_gpu_instance_is_prefixed() {
        assert_eq!(mig_profile_name(2, 3, 1, 40448, 81559 << 20), "1c.3g.40gb");
        assert_eq!(mig_profile_name(2, 3, 3, 40448, 81559 << 20), "3g.40gb");
        assert_eq!(mig_profile_name(7, 1, 1, 9984, 81559 << 20), "1g.10gb+me");
        assert_eq!(mig_profile_name(13, 1, 1, 9984, 81559 << 20), "1g.10gb-me");
    }

    #[test]
    fn bus_ids_are_normalized_to_nvmls_eight_digit_upper_case_form() {
        assert_eq!(
            normalize_bus_id("00000000:18:00.0").as_deref(),
            Some("00000000:18:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000000000000000:2a:00.0").as_deref(),
            Some("00000000:2A:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:c1:00.1").as_deref(),
            Some("00000000:C1:00.1")
        );
        assert_eq!(
            normalize_bus_id("c1:00.0").as_deref(),
            Some("00000000:C1:00.0")
        );
        assert_eq!(
            normalize_bus_id("00000001:18:00.0\0").as_deref(),
            Some("00000001:18:00.0")
        );
        assert_eq!(normalize_bus_id("not a bus id"), None);
        assert_eq!(normalize_bus_id("0000:18:00.9"), None);
    }

    #[test]
    fn cuda_driver_versions_read_as_major_dot_minor() {
        assert_eq!(cuda_version(12040), "12.4");
        assert_eq!(cuda_version(12020), "12.2");
        assert_eq!(cuda_version(11080), "11.8");
    }
}
