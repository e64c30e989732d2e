//! The NVML calls every reader shares: a failed call named ([`CallError`], [`Call`]), an NVML
//! error in operators' words ([`describe`]), and a GPU's GPU-instance profiles.

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProfileInfo;
use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::NVML_GPU_INSTANCE_PROFILE_COUNT;
use std::fmt;

/// A failed NVML call: which one, and why.
#[derive(Debug)]
pub(super) struct CallError {
    pub call: &'static str,
    pub reason: String,
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.call, self.reason)
    }
}

/// Names the NVML call a wrapper error came from.
pub(super) trait Call<T> {
    fn call(self, name: &'static str) -> Result<T, CallError>;
}

impl<T> Call<T> for Result<T, NvmlError> {
    fn call(self, name: &'static str) -> Result<T, CallError> {
        self.map_err(|e| CallError {
            call: name,
            reason: describe(&e),
        })
    }
}

/// Human wording of an NVML error; "GPU is lost" gets the words operators search for.
pub(super) fn describe(e: &NvmlError) -> String {
    match e {
        NvmlError::GpuLost => "GPU is lost (fell off the bus or is otherwise inaccessible)".into(),
        other => other.to_string(),
    }
}

/// The GPU-instance profiles a GPU offers, by `NVML_GPU_INSTANCE_PROFILE_*` index.
pub(super) fn instance_profiles(parent: &Device<'_>) -> Result<Vec<(u32, ProfileInfo)>, CallError> {
    let mut out = Vec::new();
    for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        match parent.profile_info(index) {
            Ok(info) => out.push((index, info)),
            Err(NvmlError::NotSupported | NvmlError::InvalidArg | NvmlError::NotFound) => {}
            Err(e) => return Err(e).call("nvmlDeviceGetGpuInstanceProfileInfo"),
        }
    }
    Ok(out)
}
