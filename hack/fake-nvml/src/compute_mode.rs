//! Compute modes: `nvmlDeviceGetComputeMode` and `nvmlDeviceSetComputeMode`, per GPU, kept in
//! the state file like the MIG instances (`persist.rs`), `DEFAULT` until set.
//!
//! What NVML documents, and the fake follows (NVML API reference, "Device Queries"
//! `nvmlDeviceGetComputeMode` and "Device Commands" `nvmlDeviceSetComputeMode`,
//! docs.nvidia.com/deploy/nvml-api): "For all products"; setting "requires root/admin
//! permissions" (the fake does not check, as it checks no permission), "takes effect
//! immediately" and "under Linux it is not persistent across reboots and always resets to
//! Default" (here: a process without a state file starts from `DEFAULT`, as after a driver
//! load); `NVML_ERROR_INVALID_ARGUMENT` "if device is invalid or mode is invalid" (or, for the
//! query, the out-pointer NULL); `NVML_ERROR_GPU_IS_LOST` for a GPU off the bus.
//!
//! MIG device handles answer `NVML_ERROR_NOT_SUPPORTED`. The reference up to R570 documents the
//! calls for a device without a word on MIG; newer headers (as generated into NVIDIA's
//! cuda-python bindings) say they take "the target device handle or MIG device handle" and
//! "if MIG is enabled on a GPU, device must be MIG device handle", without saying what a whole
//! GPU's handle then gets. That being unclear and release-dependent, the fake keeps one mode
//! per GPU, settable through the GPU's handle whether MIG is on or not, and refuses MIG device
//! handles.
//!
//! `NVML_COMPUTEMODE_EXCLUSIVE_THREAD` (1) is in the enum but its support was removed from the
//! driver (nvml.h marks it so), so setting it answers `NVML_ERROR_NOT_SUPPORTED`; values past
//! the enum (`NVML_COMPUTEMODE_COUNT` and up) are `NVML_ERROR_INVALID_ARGUMENT`.

use crate::state::{with_fake, Dev};
use crate::{entry, put, Ret, INVALID_ARGUMENT, NOT_SUPPORTED};
use gpuplane_model::source::ComputeMode;
use nvml_wrapper_sys::bindings::*;

const DEFAULT: nvmlComputeMode_t = nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT;
const EXCLUSIVE_THREAD: nvmlComputeMode_t = nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_THREAD;
const PROHIBITED: nvmlComputeMode_t = nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED;
const EXCLUSIVE_PROCESS: nvmlComputeMode_t =
    nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_PROCESS;

fn to_nvml(mode: ComputeMode) -> nvmlComputeMode_t {
    match mode {
        ComputeMode::Default => DEFAULT,
        ComputeMode::ExclusiveProcess => EXCLUSIVE_PROCESS,
        ComputeMode::Prohibited => PROHIBITED,
    }
}

fn from_nvml(mode: nvmlComputeMode_t) -> Result<ComputeMode, Ret> {
    match mode {
        DEFAULT => Ok(ComputeMode::Default),
        EXCLUSIVE_PROCESS => Ok(ComputeMode::ExclusiveProcess),
        PROHIBITED => Ok(ComputeMode::Prohibited),
        EXCLUSIVE_THREAD => Err(NOT_SUPPORTED),
        _ => Err(INVALID_ARGUMENT),
    }
}

/// The GPU index behind a device handle; a MIG device's is `NVML_ERROR_NOT_SUPPORTED`.
fn gpu_index(f: &crate::state::Fake, device: nvmlDevice_t) -> Result<u32, Ret> {
    match f.dev(device)? {
        Dev::Gpu(i, _) => Ok(i),
        Dev::Mig(..) => Err(NOT_SUPPORTED),
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| {
            let i = gpu_index(f, device)?;
            let mode = f.compute_modes.get(i as usize).ok_or(INVALID_ARGUMENT)?;
            Ok(to_nvml(*mode))
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(mode, value) }
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceSetComputeMode(
    device: nvmlDevice_t,
    mode: nvmlComputeMode_t,
) -> nvmlReturn_t {
    entry(|| {
        with_fake(|f| {
            let i = gpu_index(f, device)?;
            f.set_compute_mode(i, from_nvml(mode)?)
        })
    })
}
