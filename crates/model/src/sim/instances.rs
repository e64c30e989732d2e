//! MIG instances created and destroyed on a simulated GPU: the one implementation behind both
//! `SimSource::create_mig`/`destroy_mig` and the fake libnvidia-ml's GPU- and compute-instance
//! calls, so the two admit the same requests (by [`MigCatalogue::admit`]), hand out the same
//! ids and UUIDs, and list the same MIG devices afterwards.
//!
//! The rules a simulated GPU follows:
//!
//! * **GPU-instance id**: the smallest id from 1 up that no GPU instance of the GPU holds.
//!   Real NVML numbers GPU instances by its own scheme (on A100 and H100 the id follows the
//!   placement); NVML only promises an id unique on its GPU, and nothing in gpuplane relies on
//!   more, so the simplest rule with that property stands in for it.
//! * **Compute-instance id**: 0, the one compute instance spanning its GPU instance.
//! * **MIG UUID**: derived from the parent UUID, the GPU- and compute-instance ids and the
//!   GPU's creation number (how many compute instances were created on it so far, this one
//!   included). Deterministic, so two simulations of the same sequence agree, and new for every
//!   creation, because real NVML gives a re-created instance (same ids, same placement) a new
//!   UUID, and a client must not mistake it for the old one.
//! * A GPU instance may exist without a compute instance ([`BareInstance`]): NVML creates the
//!   two in separate calls, and a destroyed compute instance leaves its GPU instance behind.
//!   It takes its memory slices and engines all the same, but is no MIG device.

use super::profile::derived_uuid;
use crate::inventory::mig::{self, MigCatalogue, MigProfileSpec, PlacedInstance, PlacementRefused};
use crate::inventory::{DeviceUuid, Gpu, MigDevice};
use serde::{Deserialize, Serialize};

/// A GPU instance without a compute instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BareInstance {
    pub id: u32,
    /// Its profile's name in the GPU's table.
    pub profile: String,
    pub start: u32,
}

/// What a simulated GPU keeps about its MIG instances beyond its [`Gpu`] record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceBook {
    /// Compute instances created on the GPU so far: the creation number of the next one's
    /// UUID is one more.
    #[serde(default)]
    pub created: u32,
    #[serde(default)]
    pub bare: Vec<BareInstance>,
}

/// Why a simulated GPU does not create a GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CreateRefused {
    /// The hardware's placement rule ([`MigCatalogue::admit`]).
    #[error("{0}")]
    Placement(PlacementRefused),
    /// An instance already on the GPU has a profile its table lacks, so what it occupies is
    /// unknown and nothing more is placed beside it.
    #[error(
        "the GPU instance {id} of profile {profile} is not of table {table}, so what it occupies \
         is unknown; destroy it first"
    )]
    Unaccounted {
        id: u32,
        profile: String,
        table: &'static str,
    },
}

/// Why a compute instance was not created on a GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ComputeRefused {
    /// No GPU instance with that id.
    #[error("no GPU instance {0}")]
    NoGpuInstance(u32),
    /// The GPU instance already has its compute instance (one spans all its slices).
    #[error("GPU instance {0} already has a compute instance spanning it")]
    Full(u32),
    /// The GPU instance's profile is not in the GPU's table.
    #[error("{0}")]
    Invalid(String),
}

/// Why a GPU instance was not destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DestroyRefused {
    #[error("no GPU instance {0}")]
    NotFound(u32),
    /// Compute instances still exist in it (NVML's `NVML_ERROR_IN_USE`).
    #[error("GPU instance {0} still has compute instances; destroy them first")]
    InUse(u32),
}

/// The table a simulated GPU's instances follow: the one its inventory names, else the one its
/// product name leads to.
pub fn table(gpu: &Gpu) -> Option<&'static MigCatalogue> {
    gpu.mig
        .table
        .as_deref()
        .and_then(mig::catalogue)
        .or_else(|| mig::catalogue_for_product(&gpu.product_name))
}

/// A MIG device's table profile: its name less a compute-instance prefix (`1c.3g.40gb`).
fn profile_of(table: &MigCatalogue, device: &MigDevice) -> Option<&'static MigProfileSpec> {
    let name = device.profile.as_str();
    let base = match name.split_once("c.") {
        Some((n, rest)) if n.parse::<u32>().is_ok() => rest,
        _ => name,
    };
    table.profile(base)
}

/// Every GPU instance of `gpu` with its id: one per GPU instance its MIG devices sit in, and the
/// bare ones.
pub fn gpu_instances(
    table: &MigCatalogue,
    gpu: &Gpu,
    book: &InstanceBook,
) -> Result<Vec<(u32, PlacedInstance)>, CreateRefused> {
    let mut out: Vec<(u32, PlacedInstance)> = Vec::new();
    for device in &gpu.mig_devices {
        if out.iter().any(|(id, _)| *id == device.gpu_instance_id) {
            continue;
        }
        let profile = profile_of(table, device).ok_or_else(|| CreateRefused::Unaccounted {
            id: device.gpu_instance_id,
            profile: device.profile.to_string(),
            table: table.name,
        })?;
        let start = device.placement.start;
        out.push((device.gpu_instance_id, PlacedInstance { profile, start }));
    }
    for bare in &book.bare {
        let profile = table
            .profile(&bare.profile)
            .ok_or_else(|| CreateRefused::Unaccounted {
                id: bare.id,
                profile: bare.profile.clone(),
                table: table.name,
            })?;
        let start = bare.start;
        out.push((bare.id, PlacedInstance { profile, start }));
    }
    Ok(out)
}

/// Creates a GPU instance of `profile` at memory slice `start` if the hardware would: it is
/// added to `book` as a bare instance, and returned.
pub fn create_gpu_instance(
    table: &MigCatalogue,
    gpu: &Gpu,
    book: &mut InstanceBook,
    profile: &'static MigProfileSpec,
    start: u32,
) -> Result<BareInstance, CreateRefused> {
    let existing = gpu_instances(table, gpu, book)?;
    let placed: Vec<PlacedInstance> = existing.iter().map(|(_, p)| *p).collect();
    table
        .admit(&placed, profile, start)
        .map_err(CreateRefused::Placement)?;
    let id = (1..)
        .find(|id| !existing.iter().any(|(taken, _)| taken == id))
        .unwrap_or(u32::MAX);
    let bare = BareInstance {
        id,
        profile: profile.name.to_string(),
        start,
    };
    book.bare.push(bare.clone());
    Ok(bare)
}

/// Creates the compute instance (id 0) spanning bare GPU instance `gpu_instance_id`: its MIG
/// device joins `gpu.mig_devices` in (GPU instance, compute instance) order, and is returned.
pub fn create_compute_instance(
    table: &MigCatalogue,
    gpu: &mut Gpu,
    book: &mut InstanceBook,
    gpu_instance_id: u32,
) -> Result<MigDevice, ComputeRefused> {
    let Some(at) = book.bare.iter().position(|b| b.id == gpu_instance_id) else {
        return Err(
            if gpu
                .mig_devices
                .iter()
                .any(|d| d.gpu_instance_id == gpu_instance_id)
            {
                ComputeRefused::Full(gpu_instance_id)
            } else {
                ComputeRefused::NoGpuInstance(gpu_instance_id)
            },
        );
    };
    let bare = &book.bare[at];
    let profile = table.profile(&bare.profile).ok_or_else(|| {
        ComputeRefused::Invalid(format!(
            "GPU instance {gpu_instance_id} has profile {}, which table {} lacks",
            bare.profile, table.name
        ))
    })?;
    let creation = book.created + 1;
    let seed = format!("{}/{gpu_instance_id}/0/created-{creation}", gpu.uuid);
    let uuid = DeviceUuid::parse(derived_uuid("MIG-", &seed))
        .map_err(|e| ComputeRefused::Invalid(e.to_string()))?;
    let device = profile
        .device(&gpu.uuid, uuid, gpu_instance_id, 0, bare.start)
        .map_err(|e| ComputeRefused::Invalid(e.to_string()))?;
    book.bare.remove(at);
    book.created = creation;
    insert_ordered(&mut gpu.mig_devices, device.clone());
    Ok(device)
}

/// Inserts a MIG device keeping the list ordered by (GPU instance, compute instance), as the
/// inventory requires.
fn insert_ordered(devices: &mut Vec<MigDevice>, device: MigDevice) {
    let key = |d: &MigDevice| (d.gpu_instance_id, d.compute_instance_id);
    let at = devices.partition_point(|d| key(d) < key(&device));
    devices.insert(at, device);
}

/// Destroys compute instance `compute_instance_id` of GPU instance `gpu_instance_id`: its MIG
/// device leaves `gpu.mig_devices`, and a GPU instance left with none becomes bare. `None` when
/// there is no such compute instance.
pub fn destroy_compute_instance(
    table: &MigCatalogue,
    gpu: &mut Gpu,
    book: &mut InstanceBook,
    gpu_instance_id: u32,
    compute_instance_id: u32,
) -> Option<MigDevice> {
    let at = gpu.mig_devices.iter().position(|d| {
        d.gpu_instance_id == gpu_instance_id && d.compute_instance_id == compute_instance_id
    })?;
    let device = gpu.mig_devices.remove(at);
    let left = gpu
        .mig_devices
        .iter()
        .any(|d| d.gpu_instance_id == gpu_instance_id);
    if !left {
        let profile = profile_of(table, &device)
            .map_or_else(|| device.profile.to_string(), |p| p.name.to_string());
        book.bare.push(BareInstance {
            id: gpu_instance_id,
            profile,
            start: device.placement.start,
        });
    }
    Some(device)
}

/// Destroys GPU instance `gpu_instance_id`, which must have no compute instance left.
pub fn destroy_gpu_instance(
    gpu: &Gpu,
    book: &mut InstanceBook,
    gpu_instance_id: u32,
) -> Result<(), DestroyRefused> {
    if let Some(at) = book.bare.iter().position(|b| b.id == gpu_instance_id) {
        book.bare.remove(at);
        return Ok(());
    }
    if gpu
        .mig_devices
        .iter()
        .any(|d| d.gpu_instance_id == gpu_instance_id)
    {
        return Err(DestroyRefused::InUse(gpu_instance_id));
    }
    Err(DestroyRefused::NotFound(gpu_instance_id))
}

/// What a whole create (GPU instance and its compute instance, as `DeviceSource::create_mig`
/// asks) refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("{0}")]
    Create(CreateRefused),
    #[error("{0}")]
    Compute(ComputeRefused),
}

/// Creates a GPU instance and the compute instance spanning it in one step; nothing is left
/// behind when either is refused.
pub fn create(
    table: &MigCatalogue,
    gpu: &mut Gpu,
    book: &mut InstanceBook,
    profile: &'static MigProfileSpec,
    start: u32,
) -> Result<MigDevice, Refused> {
    let bare = create_gpu_instance(table, gpu, book, profile, start).map_err(Refused::Create)?;
    create_compute_instance(table, gpu, book, bare.id).map_err(|e| {
        book.bare.retain(|b| b.id != bare.id);
        Refused::Compute(e)
    })
}

/// Destroys every compute instance of GPU instance `gpu_instance_id` and then the GPU
/// instance; `false` when there was no such GPU instance.
pub fn destroy(
    table: &MigCatalogue,
    gpu: &mut Gpu,
    book: &mut InstanceBook,
    gpu_instance_id: u32,
) -> bool {
    let cis: Vec<u32> = gpu
        .mig_devices
        .iter()
        .filter(|d| d.gpu_instance_id == gpu_instance_id)
        .map(|d| d.compute_instance_id)
        .collect();
    for ci in cis {
        destroy_compute_instance(table, gpu, book, gpu_instance_id, ci);
    }
    destroy_gpu_instance(gpu, book, gpu_instance_id).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100_gpu() -> Gpu {
        let mut inventory = crate::sim::load("dgx-h100").unwrap();
        let mut gpu = inventory.gpus.remove(0);
        gpu.mig.current = true;
        gpu
    }

    #[test]
    fn ids_are_the_smallest_free_and_devices_stay_in_instance_order() {
        let mut gpu = h100_gpu();
        let table = table(&gpu).unwrap();
        let mut book = InstanceBook::default();
        let p = |n: &str| table.profile(n).unwrap();
        let a = create(table, &mut gpu, &mut book, p("3g.40gb"), 4).unwrap();
        let b = create(table, &mut gpu, &mut book, p("2g.20gb"), 0).unwrap();
        let c = create(table, &mut gpu, &mut book, p("1g.10gb"), 2).unwrap();
        assert_eq!(
            [a.gpu_instance_id, b.gpu_instance_id, c.gpu_instance_id],
            [1, 2, 3]
        );
        assert!(destroy(table, &mut gpu, &mut book, 2));
        assert!(!destroy(table, &mut gpu, &mut book, 2), "already gone");
        let d = create(table, &mut gpu, &mut book, p("1g.10gb"), 0).unwrap();
        assert_eq!(d.gpu_instance_id, 2, "the freed id is taken again");
        let order: Vec<u32> = gpu.mig_devices.iter().map(|m| m.gpu_instance_id).collect();
        assert_eq!(order, [1, 2, 3]);
        assert_eq!(d.placement.start, 0);
        assert_eq!(d.compute_instance_id, 0);
    }

    #[test]
    fn a_recreated_instance_gets_a_new_uuid() {
        let mut gpu = h100_gpu();
        let table = table(&gpu).unwrap();
        let mut book = InstanceBook::default();
        let p = table.profile("7g.80gb").unwrap();
        let first = create(table, &mut gpu, &mut book, p, 0).unwrap();
        assert!(destroy(table, &mut gpu, &mut book, first.gpu_instance_id));
        let again = create(table, &mut gpu, &mut book, p, 0).unwrap();
        assert_eq!(first.gpu_instance_id, again.gpu_instance_id);
        assert_ne!(first.uuid, again.uuid);
        // The same sequence on a twin gives the same UUIDs.
        let mut twin = h100_gpu();
        let mut twin_book = InstanceBook::default();
        let t1 = create(table, &mut twin, &mut twin_book, p, 0).unwrap();
        assert_eq!(t1.uuid, first.uuid);
    }

    #[test]
    fn bare_instances_hold_their_slices_and_refuse_destruction_while_in_use() {
        let mut gpu = h100_gpu();
        let table = table(&gpu).unwrap();
        let mut book = InstanceBook::default();
        let four = table.profile("4g.40gb").unwrap();
        let bare = create_gpu_instance(table, &gpu, &mut book, four, 0).unwrap();
        assert!(gpu.mig_devices.is_empty(), "no MIG device without a CI");
        let three = table.profile("3g.40gb").unwrap();
        assert!(matches!(
            create_gpu_instance(table, &gpu, &mut book, three, 0),
            Err(CreateRefused::Placement(PlacementRefused::Overlaps { .. }))
        ));
        let device = create_compute_instance(table, &mut gpu, &mut book, bare.id).unwrap();
        assert_eq!(
            create_compute_instance(table, &mut gpu, &mut book, bare.id),
            Err(ComputeRefused::Full(bare.id))
        );
        assert_eq!(
            destroy_gpu_instance(&gpu, &mut book, bare.id),
            Err(DestroyRefused::InUse(bare.id))
        );
        let gone = destroy_compute_instance(table, &mut gpu, &mut book, bare.id, 0).unwrap();
        assert_eq!(gone, device);
        assert_eq!(book.bare.len(), 1, "the GPU instance is left behind");
        assert_eq!(destroy_gpu_instance(&gpu, &mut book, bare.id), Ok(()));
        assert_eq!(
            destroy_gpu_instance(&gpu, &mut book, bare.id),
            Err(DestroyRefused::NotFound(bare.id))
        );
    }
}
