//! MIG profile tables: the public facts of each MIG-capable GPU model.
//!
//! Simulation profiles name a table per GPU model; the tables decide which profile names exist,
//! where their GPU instances may be placed and what resources each carries. Figures are those
//! `nvidia-smi mig -lgip` prints for the model. The `nvml_profile` and `id` numbers are the
//! ones NVML uses, so the fake NVML library can answer profile queries from the same table.

use super::{DeviceUuid, IdError, MigDevice, MigProfile, Placement};

/// One GPU-instance profile of one GPU model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigProfileSpec {
    /// Name without the `MIG ` prefix, e.g. `1g.10gb+me`.
    pub name: &'static str,
    /// The `NVML_GPU_INSTANCE_PROFILE_*` index this profile is queried by.
    pub nvml_profile: u32,
    /// The profile id NVML reports in GPU-instance info (what `nvidia-smi` calls ID).
    pub id: u32,
    /// Compute slices, of `MigCatalogue::compute_slices`.
    pub gpu_slices: u32,
    /// Memory slices a placement covers.
    pub memory_slices: u32,
    /// Allowed placement starts, in memory slices.
    pub placements: &'static [u32],
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
}

impl MigProfileSpec {
    /// The MIG device of a compute instance spanning a whole GPU instance of this profile at
    /// memory slice `start`: what discovery lists for it. The one construction of a table
    /// profile's device, for simulation profiles and dynamically created instances alike.
    pub fn device(
        &self,
        parent_uuid: &DeviceUuid,
        uuid: DeviceUuid,
        gpu_instance_id: u32,
        compute_instance_id: u32,
        start: u32,
    ) -> Result<MigDevice, IdError> {
        Ok(MigDevice {
            uuid,
            parent_uuid: parent_uuid.clone(),
            profile: MigProfile::parse(self.name)?,
            gpu_instance_id,
            compute_instance_id,
            gpu_slices: self.gpu_slices,
            placement: Placement {
                start,
                size: self.memory_slices,
            },
            memory_mib: self.memory_mib,
            multiprocessors: self.multiprocessors,
            copy_engines: self.copy_engines,
            decoders: self.decoders,
            encoders: self.encoders,
            jpeg_engines: self.jpeg_engines,
            ofa_engines: self.ofa_engines,
        })
    }
}

/// The MIG profiles of one GPU model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigCatalogue {
    pub name: &'static str,
    pub compute_slices: u32,
    pub memory_slices: u32,
    pub profiles: &'static [MigProfileSpec],
}

impl MigCatalogue {
    pub fn profile(&self, name: &str) -> Option<&'static MigProfileSpec> {
        self.profiles.iter().find(|p| p.name == name)
    }

    pub fn profile_by_nvml_index(&self, nvml_profile: u32) -> Option<&'static MigProfileSpec> {
        self.profiles
            .iter()
            .find(|p| p.nvml_profile == nvml_profile)
    }

    pub fn profile_names(&self) -> Vec<&'static str> {
        self.profiles.iter().map(|p| p.name).collect()
    }

    /// The profile that spans the whole GPU (`7g.80gb` on an H100): its engine counts are the
    /// GPU's, which every other combination of instances shares.
    pub fn full_profile(&self) -> Option<&'static MigProfileSpec> {
        self.profiles
            .iter()
            .find(|p| p.gpu_slices == self.compute_slices && p.memory_slices == self.memory_slices)
    }

    /// Whether the hardware creates a GPU instance of `profile` at memory slice `start` next to
    /// the instances already `placed`: the rule NVML applies (and the fake libnvidia-ml and the
    /// simulated source apply the same way). The start must be one the profile allows, its
    /// memory slices free, and the compute slices and each engine kind must not exceed the
    /// GPU's (the full profile's) count; `+me` profiles take the GPU's one OFA, so only one
    /// exists at a time.
    pub fn admit(
        &self,
        placed: &[PlacedInstance],
        profile: &'static MigProfileSpec,
        start: u32,
    ) -> Result<(), PlacementRefused> {
        if !profile.placements.contains(&start) {
            return Err(PlacementRefused::StartNotAllowed {
                profile: profile.name,
                start,
                allowed: profile.placements,
            });
        }
        let wanted = PlacedInstance { profile, start };
        if let Some(other) = placed.iter().find(|p| p.overlaps(&wanted)) {
            return Err(PlacementRefused::Overlaps {
                profile: profile.name,
                start,
                other: *other,
            });
        }
        let used = |f: fn(&MigProfileSpec) -> u32| -> u32 {
            placed.iter().map(|p| f(p.profile)).sum::<u32>() + f(profile)
        };
        if used(|p| p.gpu_slices) > self.compute_slices {
            return Err(PlacementRefused::Exhausted {
                profile: profile.name,
                what: "compute slices",
            });
        }
        if let Some(full) = self.full_profile() {
            for (what, count) in ENGINES {
                if used(*count) > count(full) {
                    return Err(PlacementRefused::Exhausted {
                        profile: profile.name,
                        what,
                    });
                }
            }
        }
        Ok(())
    }
}

/// How many engines of one kind a profile takes.
pub type EngineCount = fn(&MigProfileSpec) -> u32;

/// The engine kinds a GPU instance takes, by name, as `nvidia-smi mig -lgip` counts them.
pub const ENGINES: &[(&str, EngineCount)] = &[
    ("copy engines", |p| p.copy_engines),
    ("decoders", |p| p.decoders),
    ("encoders", |p| p.encoders),
    ("JPEG engines", |p| p.jpeg_engines),
    ("OFA engines", |p| p.ofa_engines),
];

/// A GPU instance that exists (or is about to): its profile at a start memory slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedInstance {
    pub profile: &'static MigProfileSpec,
    pub start: u32,
}

impl PlacedInstance {
    pub fn overlaps(&self, other: &PlacedInstance) -> bool {
        self.start < other.start + other.profile.memory_slices
            && other.start < self.start + self.profile.memory_slices
    }
}

/// Why the hardware would not create a GPU instance (NVML answers
/// `NVML_ERROR_INSUFFICIENT_RESOURCES` for the last two, `NVML_ERROR_INVALID_ARGUMENT` for the
/// first).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementRefused {
    #[error("{profile} cannot start at memory slice {start} (allowed: {allowed:?})")]
    StartNotAllowed {
        profile: &'static str,
        start: u32,
        allowed: &'static [u32],
    },
    #[error("{profile} at memory slice {start} overlaps the {} instance at slice {}", other.profile.name, other.start)]
    Overlaps {
        profile: &'static str,
        start: u32,
        other: PlacedInstance,
    },
    #[error("no {what} left on the GPU for {profile}")]
    Exhausted {
        profile: &'static str,
        what: &'static str,
    },
}

/// Every bundled table, by name.
pub fn catalogue(name: &str) -> Option<&'static MigCatalogue> {
    CATALOGUES.iter().find(|c| c.name == name)
}

/// The bundled table of a GPU model, by the product name NVML reports
/// (`NVIDIA H100 80GB HBM3` -> `h100-80gb`, `NVIDIA A30` -> `a30-24gb`). The H100 NVL (94GB)
/// has other memory sizes, so other profile names (`1g.12gb`): no bundled table is its.
pub fn catalogue_for_product(product_name: &str) -> Option<&'static MigCatalogue> {
    let p = product_name.to_ascii_uppercase();
    let words: Vec<&str> = p
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let has = |w: &str| words.contains(&w);
    let name = if p.contains("A100") && p.contains("80GB") {
        "a100-80gb"
    } else if p.contains("A100") {
        "a100-40gb"
    } else if p.contains("H100") && !has("NVL") {
        "h100-80gb"
    } else if p.contains("H200") {
        "h200-141gb"
    } else if has("A30") {
        "a30-24gb"
    } else {
        return None;
    };
    catalogue(name)
}

pub fn catalogue_names() -> Vec<&'static str> {
    CATALOGUES.iter().map(|c| c.name).collect()
}

const ONE: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const TWO: &[u32] = &[0, 2, 4, 6];
const TWO_OF_THREE: &[u32] = &[0, 2, 4];
const HALF: &[u32] = &[0, 4];
const ONE_OF_FOUR: &[u32] = &[0, 1, 2, 3];
const TWO_OF_FOUR: &[u32] = &[0, 2];
const WHOLE: &[u32] = &[0];

#[allow(clippy::too_many_arguments)]
const fn spec(
    name: &'static str,
    nvml_profile: u32,
    id: u32,
    gpu_slices: u32,
    memory_slices: u32,
    placements: &'static [u32],
    memory_mib: u64,
    multiprocessors: u32,
    copy_engines: u32,
    decoders: u32,
    jpeg_engines: u32,
    ofa_engines: u32,
) -> MigProfileSpec {
    MigProfileSpec {
        name,
        nvml_profile,
        id,
        gpu_slices,
        memory_slices,
        placements,
        memory_mib,
        multiprocessors,
        copy_engines,
        decoders,
        encoders: 0,
        jpeg_engines,
        ofa_engines,
    }
}

// NVML profile indices (nvml.h): 1_SLICE=0, 2_SLICE=1, 3_SLICE=2, 4_SLICE=3, 7_SLICE=4,
// 1_SLICE_REV1 (+me)=7, 2_SLICE_REV1 (2g +me)=8, 1_SLICE_REV2 (double memory)=9.
const CATALOGUES: &[MigCatalogue] = &[
    MigCatalogue {
        name: "a100-40gb",
        compute_slices: 7,
        memory_slices: 8,
        profiles: &[
            spec("1g.5gb", 0, 19, 1, 1, ONE, 4864, 14, 1, 0, 0, 0),
            spec("1g.5gb+me", 7, 20, 1, 1, ONE, 4864, 14, 1, 1, 1, 1),
            spec("1g.10gb", 9, 15, 1, 2, TWO, 9856, 14, 1, 1, 0, 0),
            spec("2g.10gb", 1, 14, 2, 2, TWO_OF_THREE, 9856, 28, 2, 1, 0, 0),
            spec("3g.20gb", 2, 9, 3, 4, HALF, 20096, 42, 3, 2, 0, 0),
            spec("4g.20gb", 3, 5, 4, 4, WHOLE, 20096, 56, 4, 2, 0, 0),
            spec("7g.40gb", 4, 0, 7, 8, WHOLE, 40448, 98, 7, 5, 1, 1),
        ],
    },
    MigCatalogue {
        name: "a100-80gb",
        compute_slices: 7,
        memory_slices: 8,
        profiles: &[
            spec("1g.10gb", 0, 19, 1, 1, ONE, 9728, 14, 1, 0, 0, 0),
            spec("1g.10gb+me", 7, 20, 1, 1, ONE, 9728, 14, 1, 1, 1, 1),
            spec("1g.20gb", 9, 15, 1, 2, TWO, 19968, 14, 1, 1, 0, 0),
            spec("2g.20gb", 1, 14, 2, 2, TWO_OF_THREE, 19968, 28, 2, 1, 0, 0),
            spec("3g.40gb", 2, 9, 3, 4, HALF, 40192, 42, 3, 2, 0, 0),
            spec("4g.40gb", 3, 5, 4, 4, WHOLE, 40192, 56, 4, 2, 0, 0),
            spec("7g.80gb", 4, 0, 7, 8, WHOLE, 80640, 98, 7, 5, 1, 1),
        ],
    },
    MigCatalogue {
        name: "h100-80gb",
        compute_slices: 7,
        memory_slices: 8,
        profiles: &[
            spec("1g.10gb", 0, 19, 1, 1, ONE, 9984, 16, 1, 1, 1, 0),
            spec("1g.10gb+me", 7, 20, 1, 1, ONE, 9984, 16, 1, 1, 1, 1),
            spec("1g.20gb", 9, 15, 1, 2, TWO, 20096, 26, 1, 1, 1, 0),
            spec("2g.20gb", 1, 14, 2, 2, TWO_OF_THREE, 20096, 32, 2, 2, 2, 0),
            spec("3g.40gb", 2, 9, 3, 4, HALF, 40448, 60, 3, 3, 3, 0),
            spec("4g.40gb", 3, 5, 4, 4, WHOLE, 40448, 64, 4, 4, 4, 0),
            spec("7g.80gb", 4, 0, 7, 8, WHOLE, 81152, 132, 8, 7, 7, 1),
        ],
    },
    // A30 24GB (NVML total 24576 MiB): ids, placements, memory, SMs and engines from NVIDIA's
    // MIG user guide ("A30 MIG Profiles") and published `nvidia-smi mig -lgip` listings of an
    // A30 (memory 5.81/11.69/23.44 GiB), not read on an A30 here. The guide gives 1g.6gb no
    // NVDEC where the published driver listings show one; the listing is taken.
    // NVML indices: 2_SLICE_REV1 (8) is the 2g `+me`.
    MigCatalogue {
        name: "a30-24gb",
        compute_slices: 4,
        memory_slices: 4,
        profiles: &[
            spec("1g.6gb", 0, 14, 1, 1, ONE_OF_FOUR, 5952, 14, 1, 1, 0, 0),
            spec("1g.6gb+me", 7, 21, 1, 1, ONE_OF_FOUR, 5952, 14, 1, 1, 1, 1),
            spec("2g.12gb", 1, 5, 2, 2, TWO_OF_FOUR, 11968, 28, 2, 2, 0, 0),
            spec("2g.12gb+me", 8, 6, 2, 2, TWO_OF_FOUR, 11968, 28, 2, 2, 1, 1),
            spec("4g.24gb", 3, 0, 4, 4, WHOLE, 24000, 56, 4, 4, 1, 1),
        ],
    },
    // H200 141GB (NVML total 143771 MiB), the H100's GH100 with more memory: the same seven
    // profiles, ids, NVML indices and placements as the H100. Engines and copy engines: the
    // MIG user guide's "H200 MIG Profiles" table. Memory and SMs from published `nvidia-smi
    // mig -lgip` listings and CUDA device properties of H200 instances; 1g.35gb and 4g.71gb
    // are taken to have the memory of 2g.35gb and 3g.71gb (same memory slices, as in every
    // other table), 4g.71gb the H100's 64 SMs. Not yet read from an H200 through our NVML
    // code: that check runs when the GPU machine is lent (read-only).
    MigCatalogue {
        name: "h200-141gb",
        compute_slices: 7,
        memory_slices: 8,
        profiles: &[
            spec("1g.18gb", 0, 19, 1, 1, ONE, 16384, 16, 1, 1, 1, 0),
            spec("1g.18gb+me", 7, 20, 1, 1, ONE, 16384, 16, 1, 1, 1, 1),
            spec("1g.35gb", 9, 15, 1, 2, TWO, 33280, 26, 1, 1, 1, 0),
            spec("2g.35gb", 1, 14, 2, 2, TWO_OF_THREE, 33280, 32, 2, 2, 2, 0),
            spec("3g.71gb", 2, 9, 3, 4, HALF, 71424, 60, 3, 3, 3, 0),
            spec("4g.71gb", 3, 5, 4, 4, WHOLE, 71424, 64, 4, 4, 4, 0),
            spec("7g.141gb", 4, 0, 7, 8, WHOLE, 143360, 132, 8, 7, 7, 1),
        ],
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_catalogue_has_unique_names_indices_and_ids() {
        for c in CATALOGUES {
            for (i, a) in c.profiles.iter().enumerate() {
                for b in &c.profiles[i + 1..] {
                    assert_ne!(a.name, b.name, "{}", c.name);
                    assert_ne!(a.nvml_profile, b.nvml_profile, "{}", c.name);
                    assert_ne!(a.id, b.id, "{}", c.name);
                }
                for start in a.placements {
                    assert!(
                        start + a.memory_slices <= c.memory_slices,
                        "{} {}",
                        c.name,
                        a.name
                    );
                }
                assert!(a.gpu_slices <= c.compute_slices);
            }
        }
    }

    #[test]
    fn admit_follows_placement_overlap_and_engine_rules() {
        let h100 = catalogue("h100-80gb").unwrap();
        let p = |n: &str| h100.profile(n).unwrap();
        let at = |n: &str, start| PlacedInstance {
            profile: p(n),
            start,
        };
        // 4g at 0 and 3g at 4 fit together; 3g at 0 does not next to the 4g.
        assert_eq!(h100.admit(&[at("4g.40gb", 0)], p("3g.40gb"), 4), Ok(()));
        assert!(matches!(
            h100.admit(&[at("4g.40gb", 0)], p("3g.40gb"), 0),
            Err(PlacementRefused::Overlaps { .. })
        ));
        assert!(matches!(
            h100.admit(&[], p("3g.40gb"), 2),
            Err(PlacementRefused::StartNotAllowed { .. })
        ));
        // One +me instance: the GPU has one OFA.
        assert!(matches!(
            h100.admit(&[at("1g.10gb+me", 0)], p("1g.10gb+me"), 1),
            Err(PlacementRefused::Exhausted {
                what: "OFA engines",
                ..
            })
        ));
        assert_eq!(h100.full_profile().unwrap().name, "7g.80gb");
    }

    #[test]
    fn every_catalogue_has_a_full_profile_that_bounds_every_other() {
        for c in CATALOGUES {
            let full = c.full_profile().unwrap_or_else(|| panic!("{}", c.name));
            for p in c.profiles {
                for (what, count) in ENGINES {
                    assert!(count(p) <= count(full), "{} {} {what}", c.name, p.name);
                }
                assert!(p.multiprocessors <= full.multiprocessors, "{}", p.name);
                assert!(p.memory_mib <= full.memory_mib, "{}", p.name);
            }
        }
    }

    #[test]
    fn product_names_find_their_tables() {
        for (product, table) in [
            ("NVIDIA A100-SXM4-40GB", Some("a100-40gb")),
            ("NVIDIA A100-SXM4-80GB", Some("a100-80gb")),
            ("NVIDIA A100 80GB PCIe", Some("a100-80gb")),
            ("NVIDIA H100 80GB HBM3", Some("h100-80gb")),
            ("NVIDIA H100 PCIe", Some("h100-80gb")),
            ("NVIDIA H100 NVL", None),
            ("NVIDIA H200", Some("h200-141gb")),
            ("NVIDIA H200 NVL", Some("h200-141gb")),
            ("NVIDIA A30", Some("a30-24gb")),
            ("NVIDIA A300", None),
            ("NVIDIA L4", None),
            ("Tesla V100-SXM2-16GB", None),
        ] {
            assert_eq!(
                catalogue_for_product(product).map(|c| c.name),
                table,
                "{product}"
            );
        }
    }

    #[test]
    fn a30_and_h200_follow_their_instance_limits() {
        let a30 = catalogue("a30-24gb").unwrap();
        let p = |n: &str| a30.profile(n).unwrap();
        let at = |n: &str, start| PlacedInstance {
            profile: p(n),
            start,
        };
        // Four 1g, or one +me of either size: the A30 has one JPEG and one OFA.
        let quarters: Vec<PlacedInstance> = (0..3).map(|s| at("1g.6gb", s)).collect();
        assert_eq!(a30.admit(&quarters, p("1g.6gb+me"), 3), Ok(()));
        assert!(a30
            .admit(&[at("2g.12gb+me", 0)], p("1g.6gb+me"), 2)
            .is_err());
        assert_eq!(a30.admit(&[at("2g.12gb+me", 0)], p("2g.12gb"), 2), Ok(()));
        let h200 = catalogue("h200-141gb").unwrap();
        assert_eq!(h200.full_profile().unwrap().name, "7g.141gb");
        assert_eq!(h200.profile("1g.35gb").unwrap().placements, TWO);
    }

    #[test]
    fn profiles_are_found_by_name_and_nvml_index() {
        let h100 = catalogue("h100-80gb").unwrap();
        assert_eq!(h100.profile("1g.10gb+me").unwrap().nvml_profile, 7);
        assert_eq!(h100.profile_by_nvml_index(2).unwrap().name, "3g.40gb");
        assert!(catalogue("no-such-gpu").is_none());
    }
}
