//! GPU instances: their placements, creation, listing, lookup, info and destruction.
//!
//! Every change goes through `gpuplane_model::sim::instances`, the code `SimSource` uses too, so
//! the fake and the simulated source admit the same instances (by `MigCatalogue::admit`) and hand
//! out the same ids and UUIDs. Refusals are NVML's: `NVML_ERROR_NOT_SUPPORTED` with MIG off (or
//! no MIG at all), `NVML_ERROR_INVALID_ARGUMENT` for a profile id the GPU lacks or a placement
//! the profile does not allow, `NVML_ERROR_INSUFFICIENT_RESOURCES` for slices or engines already
//! taken, `NVML_ERROR_NOT_FOUND` for an unknown instance id, `NVML_ERROR_IN_USE` for a GPU
//! instance that still has compute instances.

use crate::state::{with_fake, Fake, Handle};
use crate::{
    entry, put, put_all, Ret, INSUFFICIENT_RESOURCES, INSUFFICIENT_SIZE, INVALID_ARGUMENT, IN_USE,
    NOT_FOUND, NOT_SUPPORTED, UNKNOWN,
};
use gpuplane_model::inventory::mig::{MigProfileSpec, PlacedInstance, PlacementRefused};
use gpuplane_model::sim::instances::{self, CreateRefused, DestroyRefused};
use nvml_wrapper_sys::bindings::*;
use std::ffi::c_uint;

/// The GPU instances of GPU `gpu` with their ids (MIG devices' and bare ones).
pub(crate) fn gpu_instances(f: &Fake, gpu: u32) -> Result<Vec<(u32, PlacedInstance)>, Ret> {
    let (table, _) = f.mig_table(gpu)?;
    instances::gpu_instances(table, f.gpu_at(gpu)?, f.book(gpu)?).map_err(|_| UNKNOWN)
}

/// Resolves a GPU-instance handle to (GPU index, instance id, instance); a handle of a
/// destroyed instance is invalid.
pub(crate) fn resolve(
    f: &Fake,
    handle: nvmlGpuInstance_t,
) -> Result<(u32, u32, PlacedInstance), Ret> {
    let Some(Handle::GpuInstance { gpu, id }) = Handle::of(handle) else {
        return Err(INVALID_ARGUMENT);
    };
    let (_, placed) = gpu_instances(f, gpu)?
        .into_iter()
        .find(|(i, _)| *i == id)
        .ok_or(INVALID_ARGUMENT)?;
    Ok((gpu, id, placed))
}

/// The table profile of GPU `gpu` with NVML profile id `profile_id`.
fn profile_by_id(f: &Fake, gpu: u32, profile_id: u32) -> Result<&'static MigProfileSpec, Ret> {
    let (table, _) = f.mig_table(gpu)?;
    table
        .profiles
        .iter()
        .find(|p| p.id == profile_id)
        .ok_or(INVALID_ARGUMENT)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        if count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // Answered whether or not MIG is on, as NVML documents.
        let all: Vec<nvmlGpuInstancePlacement_t> = with_fake(|f| {
            let (i, _) = f.gpu(device)?;
            let p = profile_by_id(f, i, profile_id).map_err(|_| NOT_SUPPORTED)?;
            Ok(p.placements
                .iter()
                .map(|start| nvmlGpuInstancePlacement_t {
                    start: *start,
                    size: p.memory_slices,
                })
                .collect())
        })?;
        let n = all.len() as c_uint;
        if placements.is_null() {
            // SAFETY: non-null caller's out-pointer (nvml.h contract).
            return unsafe { put(count, n) };
        }
        // SAFETY: non-null; `count` holds the buffer's capacity on the way in.
        let capacity = unsafe { count.read() };
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(count, n)? };
        if capacity < n {
            return Err(INSUFFICIENT_SIZE);
        }
        // SAFETY: `placements` holds `capacity >= n` entries (nvml.h contract).
        unsafe { put_all(placements, &all) }
    })
}

/// NVML's answer to a placement the rule refuses.
fn refusal_code(why: &CreateRefused) -> Ret {
    match why {
        CreateRefused::Placement(PlacementRefused::StartNotAllowed { .. }) => INVALID_ARGUMENT,
        CreateRefused::Placement(_) | CreateRefused::Unaccounted { .. } => INSUFFICIENT_RESOURCES,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        // Checked before anything is created: a created instance must be handed back.
        if placement.is_null() || instance.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and nvml.h requires a valid placement.
        let wanted = unsafe { placement.read() };
        let handle = with_fake(|f| {
            let (i, _) = f.gpu(device)?;
            let (_, current) = f.mig_table(i)?;
            if !current {
                return Err(NOT_SUPPORTED);
            }
            let p = profile_by_id(f, i, profile_id)?;
            if wanted.size != p.memory_slices {
                return Err(INVALID_ARGUMENT);
            }
            let bare = f.change_mig(i, |table, gpu, book| {
                instances::create_gpu_instance(table, gpu, book, p, wanted.start)
                    .map_err(|why| refusal_code(&why))
            })?;
            Ok(Handle::GpuInstance {
                gpu: i,
                id: bare.id,
            })
        })?;
        // SAFETY: checked non-null above; caller's out-pointer (nvml.h contract).
        unsafe { put(instance, handle.ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    out: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        if out.is_null() || count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let handles: Vec<nvmlGpuInstance_t> = with_fake(|f| {
            let (i, _) = f.gpu(device)?;
            let (_, current) = f.mig_table(i)?;
            if !current {
                return Err(NOT_SUPPORTED);
            }
            let p = profile_by_id(f, i, profile_id)?;
            Ok(gpu_instances(f, i)?
                .into_iter()
                .filter(|(_, placed)| placed.profile.id == p.id)
                .map(|(id, _)| Handle::GpuInstance { gpu: i, id }.ptr())
                .collect())
        })?;
        // SAFETY: the buffer holds the profile's instance count (nvml.h contract), which no
        // list of one profile's instances exceeds (each takes one of its placements).
        unsafe {
            put_all(out, &handles)?;
            put(count, handles.len() as c_uint)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        let handle = with_fake(|f| {
            let (i, _) = f.gpu(device)?;
            let (_, current) = f.mig_table(i)?;
            if !current {
                return Err(NOT_SUPPORTED);
            }
            gpu_instances(f, i)?
                .iter()
                .find(|(gi, _)| *gi == id)
                .ok_or(NOT_FOUND)?;
            Ok(Handle::GpuInstance { gpu: i, id })
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(instance, handle.ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| {
            let (gpu, id, placed) = resolve(f, instance)?;
            Ok(nvmlGpuInstanceInfo_t {
                device: Handle::Gpu(gpu).ptr(),
                id,
                profileId: placed.profile.id,
                placement: nvmlGpuInstancePlacement_t {
                    start: placed.start,
                    size: placed.profile.memory_slices,
                },
            })
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(info, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    entry(|| {
        with_fake(|f| {
            let (gpu, id, _) = resolve(f, instance)?;
            f.change_mig(gpu, |_, g, book| {
                instances::destroy_gpu_instance(g, book, id).map_err(|why| match why {
                    DestroyRefused::InUse(_) => IN_USE,
                    DestroyRefused::NotFound(_) => INVALID_ARGUMENT,
                })
            })
        })
    })
}
