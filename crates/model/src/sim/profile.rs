//! The profile file schema and its validation into an [`Inventory`].

use crate::inventory::mig::{self, MigCatalogue};
use crate::inventory::{Gpu, Inventory, Link, MigDevice, MigMode, PathLevel, Placement, Topology};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};

/// NVML exposes at most this many NVLinks per GPU (`NVML_NVLINK_MAX_LINKS`).
pub const MAX_NVLINKS: u32 = 18;

/// Brands and architectures as NVML names them; anything else is a typo in the profile.
/// `BRANDS` is in `nvmlBrandType` order (a brand's position is its NVML value): the fake NVML
/// library relies on it.
pub const BRANDS: &[&str] = &[
    "Unknown",
    "Quadro",
    "Tesla",
    "NVS",
    "GRID",
    "GeForce",
    "Titan",
    "VApps",
    "VPC",
    "VCS",
    "VWS",
    "CloudGaming",
    "QuadroRTX",
    "NvidiaRTX",
    "Nvidia",
    "GeForceRTX",
    "TitanRTX",
];
pub const ARCHITECTURES: &[&str] = &[
    "Kepler",
    "Maxwell",
    "Pascal",
    "Volta",
    "Turing",
    "Ampere",
    "Ada",
    "Hopper",
    "Blackwell",
];

/// A whole profile file.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProfileFile {
    /// Free text shown by `discover`.
    #[serde(default)]
    pub description: String,
    pub driver_version: String,
    pub cuda_driver_version: String,
    /// GPU models by a local name the `gpus` entries refer to.
    pub models: BTreeMap<String, ModelSpec>,
    pub gpus: Vec<GpuSpec>,
    #[serde(default)]
    pub topology: TopologySpec,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSpec {
    pub product_name: String,
    pub brand: String,
    pub architecture: String,
    pub cuda_compute_capability: String,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// NVLinks the GPU has (used for NVSwitch fabrics).
    #[serde(default)]
    pub nvlinks: u32,
    /// Name of the MIG profile table (see `inventory::mig`); absent = not MIG capable.
    #[serde(default)]
    pub mig_catalogue: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuSpec {
    pub model: String,
    pub pci_bus_id: String,
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// Defaults to a UUID derived from the profile and PCI address.
    #[serde(default)]
    pub uuid: Option<String>,
    /// Defaults to the GPU's index.
    #[serde(default)]
    pub minor: Option<u32>,
    #[serde(default)]
    pub mig: Option<MigSpec>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigSpec {
    pub enabled: bool,
    /// Mode after the next reset; defaults to `enabled`.
    #[serde(default)]
    pub pending: Option<bool>,
    #[serde(default)]
    pub devices: Vec<MigDeviceSpec>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigDeviceSpec {
    pub profile: String,
    /// Start memory slice; defaults to the first allowed free one.
    #[serde(default)]
    pub placement: Option<u32>,
    #[serde(default)]
    pub uuid: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TopologySpec {
    /// All GPUs hang off an NVSwitch fabric with their model's `nvlinks` each.
    #[serde(default)]
    pub nvswitch: bool,
    /// Direct NVLinks as `[gpuA, gpuB, count]`.
    #[serde(default)]
    pub nvlinks: Vec<[u32; 3]>,
    #[serde(default)]
    pub pcie: PcieSpec,
}

/// Groups of GPU indices sharing a PCIe ancestor; the nearest shared group decides a pair's level.
/// Pairs in no shared group are `NumaNode` when on the same NUMA node, else `System`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PcieSpec {
    #[serde(default)]
    pub same_board: Vec<Vec<u32>>,
    #[serde(default)]
    pub single_switch: Vec<Vec<u32>>,
    #[serde(default)]
    pub multiple_switches: Vec<Vec<u32>>,
    #[serde(default)]
    pub host_bridge: Vec<Vec<u32>>,
}

/// A validation failure: (field path, reason).
type Invalid = (String, String);

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Invalid {
    (field.into(), reason.into())
}

impl ProfileFile {
    /// Validates the profile and builds the inventory it describes.
    pub fn into_inventory(self, label: &str) -> Result<Inventory, Invalid> {
        check_version("driverVersion", &self.driver_version, 2..=4)?;
        check_version("cudaDriverVersion", &self.cuda_driver_version, 2..=2)?;
        for (name, model) in &self.models {
            check_model(name, model)?;
        }
        if self.gpus.is_empty() {
            return Err(invalid("gpus", "a profile needs at least one GPU"));
        }
        let mut gpus = Vec::with_capacity(self.gpus.len());
        let mut seen_bus = BTreeSet::new();
        let mut seen_uuid = BTreeSet::new();
        let mut seen_minor = BTreeSet::new();
        for (i, spec) in self.gpus.iter().enumerate() {
            let field = format!("gpus[{i}]");
            let gpu = build_gpu(&self.models, spec, i as u32, label, &field)?;
            if !seen_bus.insert(gpu.pci_bus_id.clone()) {
                return Err(invalid(
                    format!("{field}.pciBusId"),
                    format!("{} is used by another GPU", gpu.pci_bus_id),
                ));
            }
            if !seen_minor.insert(gpu.minor) {
                return Err(invalid(
                    format!("{field}.minor"),
                    format!("minor {} is used by another GPU", gpu.minor),
                ));
            }
            for uuid in std::iter::once(&gpu.uuid).chain(gpu.mig_devices.iter().map(|m| &m.uuid)) {
                if !seen_uuid.insert(uuid.clone()) {
                    return Err(invalid(field.clone(), format!("UUID {uuid} is used twice")));
                }
            }
            gpus.push(gpu);
        }
        let topology = build_topology(&self.models, &self.gpus, &gpus, &self.topology)?;
        Ok(Inventory {
            driver_version: self.driver_version,
            cuda_driver_version: self.cuda_driver_version,
            gpus,
            topology,
        })
    }
}

fn check_version(
    field: &str,
    v: &str,
    parts: std::ops::RangeInclusive<usize>,
) -> Result<(), Invalid> {
    let n = v.split('.').count();
    if !parts.contains(&n)
        || v.split('.')
            .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(invalid(
            field,
            format!(
                "`{v}` is not a dotted version of {}..{} numbers",
                parts.start(),
                parts.end()
            ),
        ));
    }
    Ok(())
}

fn check_model(name: &str, m: &ModelSpec) -> Result<(), Invalid> {
    let field = |f: &str| format!("models.{name}.{f}");
    if !BRANDS.contains(&m.brand.as_str()) {
        return Err(invalid(
            field("brand"),
            format!("unknown brand `{}`; one of {}", m.brand, BRANDS.join(", ")),
        ));
    }
    if !ARCHITECTURES.contains(&m.architecture.as_str()) {
        return Err(invalid(
            field("architecture"),
            format!(
                "unknown architecture `{}`; one of {}",
                m.architecture,
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    check_version(
        &field("cudaComputeCapability"),
        &m.cuda_compute_capability,
        2..=2,
    )?;
    if m.product_name.is_empty() || m.product_name.len() > 95 {
        return Err(invalid(field("productName"), "must be 1 to 95 characters"));
    }
    if m.memory_mib == 0 {
        return Err(invalid(field("memoryMiB"), "must be positive"));
    }
    if m.nvlinks > MAX_NVLINKS {
        return Err(invalid(
            field("nvlinks"),
            format!("{} exceeds NVML's {MAX_NVLINKS} links per GPU", m.nvlinks),
        ));
    }
    if let Some(c) = &m.mig_catalogue {
        if mig::catalogue(c).is_none() {
            return Err(invalid(
                field("migCatalogue"),
                format!(
                    "unknown MIG table `{c}`; one of {}",
                    mig::catalogue_names().join(", ")
                ),
            ));
        }
    }
    Ok(())
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// NVML's bus id form: `DDDDDDDD:BB:DD.F`, hex, upper-case.
fn normalize_bus_id(field: &str, raw: &str) -> Result<String, Invalid> {
    let up = raw.to_ascii_uppercase();
    let ok = match up.split(':').collect::<Vec<_>>().as_slice() {
        [domain, bus, devfn] => match devfn.split_once('.') {
            Some((dev, func)) => {
                is_hex(domain, 8)
                    && is_hex(bus, 2)
                    && is_hex(dev, 2)
                    && func.len() == 1
                    && matches!(func.as_bytes()[0], b'0'..=b'7')
            }
            None => false,
        },
        _ => false,
    };
    if !ok {
        return Err(invalid(
            field,
            format!("`{raw}` is not a PCI address like 00000000:18:00.0"),
        ));
    }
    Ok(up)
}

fn check_uuid(field: &str, uuid: &str, prefix: &str) -> Result<(), Invalid> {
    let body = uuid.strip_prefix(prefix).unwrap_or("");
    let groups: Vec<&str> = body.split('-').collect();
    let lens = [8, 4, 4, 4, 12];
    if groups.len() != 5 || groups.iter().zip(lens).any(|(g, l)| !is_hex(g, l)) {
        return Err(invalid(
            field,
            format!("`{uuid}` is not a UUID like {prefix}xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"),
        ));
    }
    Ok(())
}

/// A stable UUID for simulated devices, so repeated runs and the fake NVML agree.
pub fn derived_uuid(prefix: &str, seed: &str) -> String {
    let hash = |basis: u64| {
        seed.bytes().fold(basis, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    let (a, b) = (hash(0xcbf2_9ce4_8422_2325), hash(0x6c62_272e_07bb_0142));
    let hex = format!("{a:016x}{b:016x}");
    format!(
        "{prefix}{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn build_gpu(
    models: &BTreeMap<String, ModelSpec>,
    spec: &GpuSpec,
    index: u32,
    label: &str,
    field: &str,
) -> Result<Gpu, Invalid> {
    let model = models.get(&spec.model).ok_or_else(|| {
        invalid(
            format!("{field}.model"),
            format!(
                "no model `{}` under `models` (defined: {})",
                spec.model,
                models.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        )
    })?;
    let pci_bus_id = normalize_bus_id(&format!("{field}.pciBusId"), &spec.pci_bus_id)?;
    let uuid = match &spec.uuid {
        Some(u) => {
            check_uuid(&format!("{field}.uuid"), u, "GPU-")?;
            u.clone()
        }
        None => derived_uuid("GPU-", &format!("{label}/{pci_bus_id}")),
    };
    let mig_spec = spec.mig.clone().unwrap_or(MigSpec {
        enabled: false,
        pending: None,
        devices: Vec::new(),
    });
    let catalogue = model.mig_catalogue.as_deref().and_then(mig::catalogue);
    if (mig_spec.enabled || mig_spec.pending == Some(true)) && catalogue.is_none() {
        return Err(invalid(
            format!("{field}.mig"),
            format!(
                "model `{}` is not MIG capable (no migCatalogue)",
                spec.model
            ),
        ));
    }
    if !mig_spec.enabled && !mig_spec.devices.is_empty() {
        return Err(invalid(
            format!("{field}.mig.devices"),
            "MIG devices listed but MIG is not enabled",
        ));
    }
    let mig_devices = match catalogue {
        Some(c) if mig_spec.enabled => {
            build_mig_devices(c, &mig_spec.devices, &uuid, &format!("{field}.mig.devices"))?
        }
        _ => Vec::new(),
    };
    Ok(Gpu {
        index,
        minor: spec.minor.unwrap_or(index),
        uuid,
        product_name: model.product_name.clone(),
        brand: model.brand.clone(),
        architecture: model.architecture.clone(),
        cuda_compute_capability: model.cuda_compute_capability.clone(),
        memory_mib: model.memory_mib,
        pci_bus_id,
        numa_node: spec.numa_node,
        mig: MigMode {
            current: mig_spec.enabled,
            pending: mig_spec.pending.unwrap_or(mig_spec.enabled),
            capable: catalogue.is_some(),
        },
        mig_devices,
    })
}

fn build_mig_devices(
    c: &MigCatalogue,
    specs: &[MigDeviceSpec],
    parent_uuid: &str,
    field: &str,
) -> Result<Vec<MigDevice>, Invalid> {
    let mut out: Vec<MigDevice> = Vec::with_capacity(specs.len());
    let mut compute_used = 0;
    for (i, spec) in specs.iter().enumerate() {
        let f = format!("{field}[{i}]");
        let p = c.profile(&spec.profile).ok_or_else(|| {
            invalid(
                format!("{f}.profile"),
                format!(
                    "unknown MIG profile `{}` for {}; one of {}",
                    spec.profile,
                    c.name,
                    c.profile_names().join(", ")
                ),
            )
        })?;
        compute_used += p.gpu_slices;
        if compute_used > c.compute_slices {
            return Err(invalid(
                f,
                format!(
                    "MIG devices need {compute_used} compute slices; the GPU has {}",
                    c.compute_slices
                ),
            ));
        }
        let free = |start: u32| {
            let pl = Placement {
                start,
                size: p.memory_slices,
            };
            out.iter().all(|d| !d.placement.overlaps(&pl))
        };
        let start = match spec.placement {
            Some(s) if !p.placements.contains(&s) => {
                return Err(invalid(
                    format!("{f}.placement"),
                    format!(
                        "{} can start only at memory slice {:?}, not {s}",
                        p.name, p.placements
                    ),
                ));
            }
            Some(s) if !free(s) => {
                return Err(invalid(
                    format!("{f}.placement"),
                    format!("{} at slice {s} overlaps another MIG device", p.name),
                ));
            }
            Some(s) => s,
            None => *p.placements.iter().find(|s| free(**s)).ok_or_else(|| {
                invalid(
                    f.clone(),
                    format!(
                        "no free placement left for {} (memory slices exhausted)",
                        p.name
                    ),
                )
            })?,
        };
        let gpu_instance_id = i as u32 + 1;
        let uuid = match &spec.uuid {
            Some(u) => {
                check_uuid(&format!("{f}.uuid"), u, "MIG-")?;
                u.clone()
            }
            None => derived_uuid("MIG-", &format!("{parent_uuid}/{gpu_instance_id}/0")),
        };
        out.push(MigDevice {
            uuid,
            parent_uuid: parent_uuid.to_string(),
            profile: p.name.to_string(),
            gpu_instance_id,
            compute_instance_id: 0,
            gpu_slices: p.gpu_slices,
            placement: Placement {
                start,
                size: p.memory_slices,
            },
            memory_mib: p.memory_mib,
            multiprocessors: p.multiprocessors,
            copy_engines: p.copy_engines,
            decoders: p.decoders,
            encoders: p.encoders,
            jpeg_engines: p.jpeg_engines,
            ofa_engines: p.ofa_engines,
        });
    }
    Ok(out)
}

fn build_topology(
    models: &BTreeMap<String, ModelSpec>,
    specs: &[GpuSpec],
    gpus: &[Gpu],
    t: &TopologySpec,
) -> Result<Topology, Invalid> {
    let n = gpus.len() as u32;
    if t.nvswitch && !t.nvlinks.is_empty() {
        return Err(invalid(
            "topology.nvlinks",
            "direct NVLinks and an NVSwitch fabric cannot be mixed in one profile",
        ));
    }
    let mut direct: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    let mut per_gpu = vec![0u32; gpus.len()];
    for (i, [a, b, count]) in t.nvlinks.iter().copied().enumerate() {
        let f = format!("topology.nvlinks[{i}]");
        if a >= n || b >= n {
            return Err(invalid(
                f,
                format!(
                    "links GPU {a} and GPU {b}, but the profile has GPUs 0..{}",
                    n - 1
                ),
            ));
        }
        if a == b || count == 0 {
            return Err(invalid(
                f,
                "a link needs two different GPUs and a positive count",
            ));
        }
        if direct.insert((a.min(b), a.max(b)), count).is_some() {
            return Err(invalid(f, format!("GPUs {a} and {b} are linked twice")));
        }
        for g in [a, b] {
            per_gpu[g as usize] += count;
            if per_gpu[g as usize] > MAX_NVLINKS {
                return Err(invalid(
                    f,
                    format!("GPU {g} would have more than NVML's {MAX_NVLINKS} NVLinks"),
                ));
            }
        }
    }
    let fabric_links = |i: usize| models.get(&specs[i].model).map_or(0, |m| m.nvlinks);
    if t.nvswitch {
        if let Some(i) = (0..gpus.len()).find(|&i| fabric_links(i) == 0) {
            return Err(invalid(
                format!("gpus[{i}].model"),
                "on an NVSwitch fabric every GPU model needs `nvlinks` > 0",
            ));
        }
    }
    let groups: [(&str, &Vec<Vec<u32>>, PathLevel); 4] = [
        ("sameBoard", &t.pcie.same_board, PathLevel::SameBoard),
        (
            "singleSwitch",
            &t.pcie.single_switch,
            PathLevel::SingleSwitch,
        ),
        (
            "multipleSwitches",
            &t.pcie.multiple_switches,
            PathLevel::MultipleSwitches,
        ),
        ("hostBridge", &t.pcie.host_bridge, PathLevel::HostBridge),
    ];
    for (name, list, _) in &groups {
        for (i, group) in list.iter().enumerate() {
            if let Some(g) = group.iter().find(|g| **g >= n) {
                return Err(invalid(
                    format!("topology.pcie.{name}[{i}]"),
                    format!("GPU {g} does not exist (the profile has GPUs 0..{})", n - 1),
                ));
            }
        }
    }
    let mut links = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            let shared =
                |list: &Vec<Vec<u32>>| list.iter().any(|g| g.contains(&a) && g.contains(&b));
            let level = groups
                .iter()
                .find(|(_, list, _)| shared(list))
                .map(|(_, _, l)| *l)
                .unwrap_or_else(|| {
                    match (gpus[a as usize].numa_node, gpus[b as usize].numa_node) {
                        (Some(x), Some(y)) if x == y => PathLevel::NumaNode,
                        _ => PathLevel::System,
                    }
                });
            let nvlinks = if t.nvswitch {
                fabric_links(a as usize).min(fabric_links(b as usize))
            } else {
                direct.get(&(a, b)).copied().unwrap_or(0)
            };
            links.push(Link {
                from: a,
                to: b,
                nvlinks,
                level,
            });
        }
    }
    Ok(Topology {
        nvswitch: t.nvswitch,
        links,
    })
}
