//! Compute modes on the driver: `nvmlDeviceGetComputeMode` and `nvmlDeviceSetComputeMode`
//! through nvml-wrapper's `Device::compute_mode` and `Device::set_compute_mode`, on the device
//! found by UUID (`nvmlDeviceGetHandleByUUID`, as `mig.rs` finds a GPU).
//!
//! NVML's answers become [`ComputeModeError`]s naming the call: an unknown UUID (`NOT_FOUND`)
//! is `NotFound`; `NOT_SUPPORTED` and `NO_PERMISSION` (setting needs root) are `Refused`;
//! anything else (`GPU_IS_LOST`, ...) is `Failed`. A UUID is passed on as given: NVML's
//! reference documents the calls per device, and newer releases accept MIG device handles too
//! ("if MIG is enabled on a GPU, device must be MIG device handle"); a driver that does not
//! answers `NOT_SUPPORTED`, as the fake libnvidia-ml does.

use super::call::describe;
use crate::inventory::DeviceUuid;
use crate::source::{ComputeMode, ComputeModeError};
use nvml_wrapper::enum_wrappers::device::ComputeMode as NvmlMode;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

/// An NVML error of `call` on `gpu` as a [`ComputeModeError`].
fn error(gpu: &DeviceUuid, call: &str, e: NvmlError) -> ComputeModeError {
    match e {
        NvmlError::NotFound => ComputeModeError::NotFound(format!(
            "{call}: no GPU {gpu} on this machine; rediscover and use a listed GPU"
        )),
        NvmlError::NotSupported => ComputeModeError::Refused(format!(
            "GPU {gpu}: {call}: not supported on this device (a MIG device, on drivers that \
             keep compute modes per GPU)"
        )),
        NvmlError::NoPermission => ComputeModeError::Refused(format!(
            "GPU {gpu}: {call}: no permission (setting a compute mode needs root)"
        )),
        e => ComputeModeError::Failed {
            call: call.to_string(),
            reason: format!("GPU {gpu}: {}", describe(&e)),
        },
    }
}

fn device<'n>(nvml: &'n Nvml, gpu: &DeviceUuid) -> Result<Device<'n>, ComputeModeError> {
    nvml.device_by_uuid(gpu.as_str())
        .map_err(|e| error(gpu, "nvmlDeviceGetHandleByUUID", e))
}

/// `DeviceSource::compute_mode` on NVML.
pub(super) fn get(nvml: &Nvml, gpu: &DeviceUuid) -> Result<ComputeMode, ComputeModeError> {
    const CALL: &str = "nvmlDeviceGetComputeMode";
    let mode = device(nvml, gpu)?
        .compute_mode()
        .map_err(|e| error(gpu, CALL, e))?;
    match mode {
        NvmlMode::Default => Ok(ComputeMode::Default),
        NvmlMode::ExclusiveProcess => Ok(ComputeMode::ExclusiveProcess),
        NvmlMode::Prohibited => Ok(ComputeMode::Prohibited),
        NvmlMode::ExclusiveThread => Err(ComputeModeError::Failed {
            call: CALL.into(),
            reason: format!(
                "GPU {gpu} reports EXCLUSIVE_THREAD, a compute mode whose support NVIDIA \
                 removed; set it to Default or Exclusive_Process (nvidia-smi -c)"
            ),
        }),
    }
}

/// `DeviceSource::set_compute_mode` on NVML.
pub(super) fn set(
    nvml: &Nvml,
    gpu: &DeviceUuid,
    mode: ComputeMode,
) -> Result<(), ComputeModeError> {
    let wanted = match mode {
        ComputeMode::Default => NvmlMode::Default,
        ComputeMode::ExclusiveProcess => NvmlMode::ExclusiveProcess,
        ComputeMode::Prohibited => NvmlMode::Prohibited,
    };
    device(nvml, gpu)?
        .set_compute_mode(wanted)
        .map_err(|e| error(gpu, "nvmlDeviceSetComputeMode", e))
}
