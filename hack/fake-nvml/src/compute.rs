//! Compute instances: their profiles, creation, listing, info and destruction.
//!
//! A GPU instance of `s` compute slices offers the compute-instance profiles NVIDIA lists for
//! it (`nvidia-smi mig -lcip`): 1, 2, 3, 4 and 7 slices up to `s`, less 3 on a 4-slice
//! instance. The fake creates only the one spanning the whole GPU instance (what gpuplane
//! creates, and what a MIG device of the inventory is); a smaller one answers
//! `NVML_ERROR_NOT_SUPPORTED`. A second compute instance on a GPU instance answers
//! `NVML_ERROR_INSUFFICIENT_RESOURCES`, as the hardware does once the slices are taken.

use crate::instances::resolve;
use crate::mig::ci_slices;
use crate::state::{with_fake, Fake, Handle};
use crate::{
    entry, fill_chars, put, put_all, Ret, ARGUMENT_VERSION_MISMATCH, INSUFFICIENT_RESOURCES,
    INVALID_ARGUMENT, NOT_SUPPORTED, UNKNOWN,
};
use gpuplane_model::inventory::mig::PlacedInstance;
use gpuplane_model::inventory::MigDevice;
use gpuplane_model::sim::instances::{self, ComputeRefused};
use nvml_wrapper_sys::bindings::*;
use std::ffi::c_uint;

/// Compute slices of each `NVML_COMPUTE_INSTANCE_PROFILE_*` index (8 and 6 slices, and the
/// 1-slice REV1, exist on no GPU of the bundled tables).
const CI_SLICES: [u32; NVML_COMPUTE_INSTANCE_PROFILE_COUNT as usize] = [1, 2, 3, 4, 7, 8, 6, 1];

/// The compute slices of CI profile `profile` on a GPU instance, or why there is none.
fn ci_profile_slices(gi: &PlacedInstance, profile: u32) -> Result<u32, Ret> {
    let slices = *CI_SLICES.get(profile as usize).ok_or(INVALID_ARGUMENT)?;
    let gi_slices = gi.profile.gpu_slices;
    let offered =
        matches!(profile, 0..=4) && slices <= gi_slices && !(slices == 3 && gi_slices == 4);
    if offered {
        Ok(slices)
    } else {
        Err(NOT_SUPPORTED)
    }
}

/// The CI profile index of a MIG device's compute instance.
fn ci_profile_of(m: &MigDevice) -> u32 {
    let slices = ci_slices(m);
    CI_SLICES.iter().position(|s| *s == slices).unwrap_or(0) as u32
}

/// Resolves a compute-instance handle to its GPU index and MIG device.
fn resolve_ci(f: &Fake, handle: nvmlComputeInstance_t) -> Result<(u32, MigDevice), Ret> {
    let Some(Handle::ComputeInstance { gpu, gi, ci }) = Handle::of(handle) else {
        return Err(INVALID_ARGUMENT);
    };
    let device = f
        .gpu_at(gpu)?
        .mig_devices
        .iter()
        .find(|m| m.gpu_instance_id == gi && m.compute_instance_id == ci)
        .ok_or(INVALID_ARGUMENT)?;
    Ok((gpu, device.clone()))
}

/// The profile info of CI profile `profile` on GPU instance `instance`, and its name.
fn ci_profile_info(
    instance: nvmlGpuInstance_t,
    profile: c_uint,
    engine_profile: c_uint,
) -> Result<(nvmlComputeInstanceProfileInfo_t, String), Ret> {
    if engine_profile >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    with_fake(|f| {
        let (_, _, gi) = resolve(f, instance)?;
        let slices = ci_profile_slices(&gi, profile)?;
        let p = gi.profile;
        let name = if slices == p.gpu_slices {
            format!("MIG {}", p.name)
        } else {
            format!("MIG {slices}c.{}", p.name)
        };
        let info = nvmlComputeInstanceProfileInfo_t {
            id: profile,
            sliceCount: slices,
            instanceCount: p.gpu_slices / slices,
            multiprocessorCount: p.multiprocessors * slices / p.gpu_slices,
            sharedCopyEngineCount: p.copy_engines,
            sharedDecoderCount: p.decoders,
            sharedEncoderCount: p.encoders,
            sharedJpegCount: p.jpeg_engines,
            sharedOfaCount: p.ofa_engines,
        };
        Ok((info, name))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    instance: nvmlGpuInstance_t,
    profile: c_uint,
    engine_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let (value, _) = ci_profile_info(instance, profile, engine_profile)?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(info, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    instance: nvmlGpuInstance_t,
    profile: c_uint,
    engine_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    entry(|| {
        if info.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let expected =
            (std::mem::size_of::<nvmlComputeInstanceProfileInfo_v2_t>() | 2 << 24) as c_uint;
        // SAFETY: non-null caller's struct (nvml.h contract); only its version is read.
        let version = unsafe { (*info).version };
        if version != expected {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let (v1, name) = ci_profile_info(instance, profile, engine_profile)?;
        let mut value = nvmlComputeInstanceProfileInfo_v2_t {
            version,
            id: v1.id,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            sharedCopyEngineCount: v1.sharedCopyEngineCount,
            sharedDecoderCount: v1.sharedDecoderCount,
            sharedEncoderCount: v1.sharedEncoderCount,
            sharedJpegCount: v1.sharedJpegCount,
            sharedOfaCount: v1.sharedOfaCount,
            name: [0; 96],
        };
        fill_chars(&mut value.name, &name);
        // SAFETY: as above, valid for a write of the whole struct.
        unsafe { put(info, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    out: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        // Checked before anything is created: a created instance must be handed back.
        if out.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let handle = with_fake(|f| {
            let (gpu, id, gi) = resolve(f, instance)?;
            if ci_profile_slices(&gi, profile_id)? != gi.profile.gpu_slices {
                // Only compute instances spanning their GPU instance are modelled.
                return Err(NOT_SUPPORTED);
            }
            let device = f.change_mig(gpu, |table, g, book| {
                instances::create_compute_instance(table, g, book, id).map_err(|why| match why {
                    ComputeRefused::Full(_) => INSUFFICIENT_RESOURCES,
                    ComputeRefused::NoGpuInstance(_) => INVALID_ARGUMENT,
                    ComputeRefused::Invalid(_) => UNKNOWN,
                })
            })?;
            Ok(Handle::ComputeInstance {
                gpu,
                gi: id,
                ci: device.compute_instance_id,
            })
        })?;
        // SAFETY: checked non-null above; caller's out-pointer (nvml.h contract).
        unsafe { put(out, handle.ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    out: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        if out.is_null() || count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let handles: Vec<nvmlComputeInstance_t> = with_fake(|f| {
            let (gpu, id, gi) = resolve(f, instance)?;
            ci_profile_slices(&gi, profile_id)?;
            Ok(f.gpu_at(gpu)?
                .mig_devices
                .iter()
                .filter(|m| m.gpu_instance_id == id && ci_profile_of(m) == profile_id)
                .map(|m| {
                    Handle::ComputeInstance {
                        gpu,
                        gi: id,
                        ci: m.compute_instance_id,
                    }
                    .ptr()
                })
                .collect())
        })?;
        // SAFETY: the buffer holds the CI profile's instance count (nvml.h contract), which the
        // compute instances of one profile in one GPU instance never exceed.
        unsafe {
            put_all(out, &handles)?;
            put(count, handles.len() as c_uint)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| {
            let (gpu, m) = resolve_ci(f, instance)?;
            Ok(nvmlComputeInstanceInfo_t {
                device: Handle::Gpu(gpu).ptr(),
                gpuInstance: Handle::GpuInstance {
                    gpu,
                    id: m.gpu_instance_id,
                }
                .ptr(),
                id: m.compute_instance_id,
                profileId: ci_profile_of(&m),
                placement: nvmlComputeInstancePlacement_t {
                    start: 0,
                    size: ci_slices(&m),
                },
            })
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(info, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(
    instance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        with_fake(|f| {
            let (gpu, m) = resolve_ci(f, instance)?;
            f.change_mig(gpu, |table, g, book| {
                instances::destroy_compute_instance(
                    table,
                    g,
                    book,
                    m.gpu_instance_id,
                    m.compute_instance_id,
                )
                .map(|_| ())
                .ok_or(INVALID_ARGUMENT)
            })
        })
    })
}
