//! One `gpus` entry of a profile turned into a [`Gpu`]: its PCI address, UUID and MIG state,
//! and the MIG devices it lists, each placed on free memory slices of its catalogue.

use super::{invalid, GpuSpec, Invalid, MigDeviceSpec, MigSpec, ModelSpec};
use crate::inventory::mig::{self, MigCatalogue, MigProfileSpec};
use crate::inventory::{DeviceUuid, Gpu, MigDevice, MigMode, Placement};
use std::collections::BTreeMap;

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

fn check_uuid(field: &str, uuid: &str, prefix: &str) -> Result<DeviceUuid, Invalid> {
    let body = uuid.strip_prefix(prefix).unwrap_or("");
    let groups: Vec<&str> = body.split('-').collect();
    let lens = [8, 4, 4, 4, 12];
    if groups.len() != 5 || groups.iter().zip(lens).any(|(g, l)| !is_hex(g, l)) {
        return Err(invalid(
            field,
            format!("`{uuid}` is not a UUID like {prefix}xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"),
        ));
    }
    DeviceUuid::parse(uuid).map_err(|e| invalid(field, e.to_string()))
}

/// A stable UUID for simulated devices, so repeated runs and the fake NVML agree; `prefix`
/// is `GPU-` or `MIG-`.
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

pub(super) fn build_gpu(
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
    let uuid_field = format!("{field}.uuid");
    let uuid = match &spec.uuid {
        Some(u) => check_uuid(&uuid_field, u, "GPU-")?,
        None => check_uuid(
            &uuid_field,
            &derived_uuid("GPU-", &format!("{label}/{pci_bus_id}")),
            "GPU-",
        )?,
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
        mig: mig_mode(&mig_spec, catalogue, &model.product_name),
        mig_devices,
    })
}

/// The MIG mode of a profile's GPU. `table` is the one NVML discovery would name: the table
/// the product name leads to, and only when it is the GPU's own, so both sources agree.
fn mig_mode(spec: &MigSpec, catalogue: Option<&MigCatalogue>, product: &str) -> MigMode {
    let matches =
        |c: &&MigCatalogue| mig::catalogue_for_product(product).is_some_and(|p| p.name == c.name);
    MigMode {
        current: spec.enabled,
        pending: spec.pending.unwrap_or(spec.enabled),
        capable: catalogue.is_some(),
        table: catalogue.filter(matches).map(|c| c.name.to_string()),
        dynamic: false,
    }
}

fn build_mig_devices(
    c: &MigCatalogue,
    specs: &[MigDeviceSpec],
    parent_uuid: &DeviceUuid,
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
        let start = mig_start(p, spec.placement, &out, &f)?;
        let gpu_instance_id = i as u32 + 1;
        let uuid_field = format!("{f}.uuid");
        let uuid = match &spec.uuid {
            Some(u) => check_uuid(&uuid_field, u, "MIG-")?,
            None => check_uuid(
                &uuid_field,
                &derived_uuid("MIG-", &format!("{parent_uuid}/{gpu_instance_id}/0")),
                "MIG-",
            )?,
        };
        let device = p
            .device(parent_uuid, uuid, gpu_instance_id, 0, start)
            .map_err(|e| invalid(format!("{f}.profile"), e.to_string()))?;
        out.push(device);
    }
    Ok(out)
}

/// The start memory slice of a MIG device of profile `p`: the one the profile asks for, which
/// must be allowed and free, else the first allowed slice that does not overlap `placed`.
fn mig_start(
    p: &MigProfileSpec,
    wanted: Option<u32>,
    placed: &[MigDevice],
    f: &str,
) -> Result<u32, Invalid> {
    let free = |start: u32| {
        let pl = Placement {
            start,
            size: p.memory_slices,
        };
        placed.iter().all(|d| !d.placement.overlaps(&pl))
    };
    match wanted {
        Some(s) if !p.placements.contains(&s) => Err(invalid(
            format!("{f}.placement"),
            format!(
                "{} can start only at memory slice {:?}, not {s}",
                p.name, p.placements
            ),
        )),
        Some(s) if !free(s) => Err(invalid(
            format!("{f}.placement"),
            format!("{} at slice {s} overlaps another MIG device", p.name),
        )),
        Some(s) => Ok(s),
        None => p
            .placements
            .iter()
            .copied()
            .find(|s| free(*s))
            .ok_or_else(|| {
                invalid(
                    f,
                    format!(
                        "no free placement left for {} (memory slices exhausted)",
                        p.name
                    ),
                )
            }),
    }
}
