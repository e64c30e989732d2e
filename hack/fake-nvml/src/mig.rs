//! MIG: device handles, instance ids, attributes and the GPU-instance profile table. GPU and
//! compute instances themselves are `instances.rs` and `compute.rs`.

use crate::state::{with_fake, Dev, Handle};
use crate::{entry, put, INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED};
use gpuplane_model::inventory::MigDevice;
use nvml_wrapper_sys::bindings::*;
use std::ffi::c_uint;

/// Compute-instance slices: from a `<n>c.` prefix of the profile name, else the whole instance.
pub(crate) fn ci_slices(m: &MigDevice) -> u32 {
    m.profile
        .split_once("c.")
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or(m.gpu_slices)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let n = with_fake(|f| {
            let (i, _) = f.gpu(device)?;
            Ok(f.extra(i)?.catalogue.map_or(0, |c| c.compute_slices))
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(count, n) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        let handle = with_fake(|f| {
            let (i, g) = f.gpu(device)?;
            let catalogue = f.extra(i)?.catalogue.ok_or(NOT_SUPPORTED)?;
            if !g.mig.current {
                return Err(NOT_SUPPORTED);
            }
            let n = g.mig_devices.len() as u32;
            if index < n {
                // Handed out in reverse (GPU instance, compute instance) order, so clients must
                // sort.
                let m = &g.mig_devices[(n - 1 - index) as usize];
                Ok(Handle::Mig {
                    gpu: i,
                    gi: m.gpu_instance_id,
                    ci: m.compute_instance_id,
                })
            } else if index < catalogue.compute_slices {
                Err(NOT_FOUND)
            } else {
                Err(INVALID_ARGUMENT)
            }
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(mig, handle.ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        let parent = with_fake(|f| match f.dev(mig)? {
            Dev::Mig(i, ..) => Ok(Handle::Gpu(i)),
            Dev::Gpu(..) => Err(INVALID_ARGUMENT),
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(device, parent.ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| Ok(c_uint::from(matches!(f.dev(device)?, Dev::Mig(..)))))?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(is_mig, value) }
    })
}

fn mig_field(
    device: nvmlDevice_t,
    field: impl FnOnce(&MigDevice) -> u32,
) -> Result<u32, crate::Ret> {
    with_fake(|f| match f.dev(device)? {
        Dev::Mig(_, _, m) => Ok(field(m)),
        Dev::Gpu(..) => Err(INVALID_ARGUMENT),
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let value = mig_field(device, |m| m.gpu_instance_id)?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(id, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let value = mig_field(device, |m| m.compute_instance_id)?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(id, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| match f.dev(device)? {
            Dev::Mig(_, _, m) => Ok(nvmlDeviceAttributes_t {
                multiprocessorCount: m.multiprocessors,
                sharedCopyEngineCount: m.copy_engines,
                sharedDecoderCount: m.decoders,
                sharedEncoderCount: m.encoders,
                sharedJpegCount: m.jpeg_engines,
                sharedOfaCount: m.ofa_engines,
                gpuInstanceSliceCount: m.gpu_slices,
                computeInstanceSliceCount: ci_slices(m),
                memorySizeMB: m.memory_mib,
            }),
            Dev::Gpu(..) => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(attributes, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        if profile >= NVML_GPU_INSTANCE_PROFILE_COUNT {
            return Err(INVALID_ARGUMENT);
        }
        let value = with_fake(|f| {
            let (i, _) = f.gpu(device)?;
            let catalogue = f.extra(i)?.catalogue.ok_or(NOT_SUPPORTED)?;
            let p = catalogue
                .profile_by_nvml_index(profile)
                .ok_or(NOT_SUPPORTED)?;
            Ok(nvmlGpuInstanceProfileInfo_t {
                id: p.id,
                isP2pSupported: 0,
                sliceCount: p.gpu_slices,
                instanceCount: p.placements.len() as c_uint,
                multiprocessorCount: p.multiprocessors,
                copyEngineCount: p.copy_engines,
                decoderCount: p.decoders,
                encoderCount: p.encoders,
                jpegCount: p.jpeg_engines,
                ofaCount: p.ofa_engines,
                memorySizeMB: p.memory_mib,
            })
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(info, value) }
    })
}
