//! Per-cgroup GPU memory limits on the driver (`nvmlDeviceSetMemoryLimits_v1`, NVIDIA driver
//! r615 / CUDA 13.4: docs.nvidia.com/deploy/mps "MPS v3 Memory Partitioning" and NVML's change
//! log), which hold a share's container to its memory whatever its environment says
//! ([`crate::cdi::memory_limit`] has the why). `nvml-wrapper`'s bindings predate the call, so
//! it is looked up by name in the same library (`raw.rs`).
//!
//! Whether a driver has it: the symbol is exported and the driver is r615 or later (the call
//! exists in the library of every later driver; asking an older one is not defined).

use super::raw;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// The first driver branch with per-cgroup memory limits.
const FIRST_DRIVER: u32 = 615;

/// The loader's name for the library when no path was given.
const DEFAULT_LIB: &str = "libnvidia-ml.so.1";

/// Why a cgroup's memory limit was not set.
#[derive(Debug, thiserror::Error)]
pub enum MemoryLimitError {
    #[error("cannot load the NVIDIA driver library {lib}: {reason}")]
    Load { lib: String, reason: String },
    #[error(
        "the NVIDIA driver ({version}) has no per-cgroup GPU memory limit; it needs driver r615 \
         or later (the agent prepares no such hook for older drivers: was the driver downgraded?)"
    )]
    Unsupported { version: String },
    #[error("GPU {gpu}: {call}: {reason}")]
    Call {
        gpu: String,
        call: &'static str,
        reason: String,
    },
}

/// The library path the agent's source names, or the loader's default.
pub(super) fn library_name(lib_path: Option<&Path>) -> PathBuf {
    lib_path.map_or_else(|| PathBuf::from(DEFAULT_LIB), Path::to_path_buf)
}

/// Whether the driver behind `nvml` (loaded from `lib`) limits GPU memory per cgroup.
pub(super) fn supported(nvml: &Nvml, lib: &Path) -> bool {
    let branch = nvml
        .sys_driver_version()
        .ok()
        .and_then(|v| v.split('.').next()?.parse::<u32>().ok());
    if branch.is_none_or(|b| b < FIRST_DRIVER) {
        return false;
    }
    libloading_open(lib).is_ok_and(|l| raw::has_memory_limits(&l))
}

fn libloading_open(lib: &Path) -> Result<libloading::Library, MemoryLimitError> {
    raw::open_library(lib).map_err(|e| MemoryLimitError::Load {
        lib: lib.display().to_string(),
        reason: e.to_string(),
    })
}

/// Holds the processes of cgroup directory `cgroup` to `bytes` of GPU `gpu`'s memory (soft
/// and hard limit alike), through the NVML library at `lib`. Needs root, as the driver does.
pub fn set_cgroup_memory_limit(
    lib: &Path,
    gpu: &str,
    cgroup: &Path,
    bytes: u64,
) -> Result<(), MemoryLimitError> {
    let nvml = Nvml::builder()
        .lib_path(lib.as_os_str())
        .init()
        .map_err(|e| MemoryLimitError::Load {
            lib: lib.display().to_string(),
            reason: super::call::describe(&e),
        })?;
    if !supported(&nvml, lib) {
        return Err(MemoryLimitError::Unsupported {
            version: nvml
                .sys_driver_version()
                .unwrap_or_else(|e| super::call::describe(&e)),
        });
    }
    let call_error = |call: &'static str| {
        move |e: NvmlError| MemoryLimitError::Call {
            gpu: gpu.to_string(),
            call,
            reason: match e {
                NvmlError::NotFound => format!(
                    "not found: no GPU {gpu}, or {} is not a cgroup v2 directory with the dmem \
                     controller enabled",
                    cgroup.display()
                ),
                NvmlError::NotSupported => {
                    "not supported on this device (MIG devices have no per-cgroup limit)".into()
                }
                NvmlError::NoPermission => "no permission (setting a limit needs root)".into(),
                e => super::call::describe(&e),
            },
        }
    };
    let device = nvml
        .device_by_uuid(gpu)
        .map_err(call_error("nvmlDeviceGetHandleByUUID"))?;
    let path = CString::new(cgroup.as_os_str().as_encoded_bytes()).map_err(|_| {
        MemoryLimitError::Call {
            gpu: gpu.to_string(),
            call: "nvmlDeviceSetMemoryLimits_v1",
            reason: format!("cgroup path {} holds a NUL byte", cgroup.display()),
        }
    })?;
    let lib = libloading_open(lib)?;
    raw::set_memory_limits(&lib, &device, &path, bytes, bytes)
        .map_err(call_error("nvmlDeviceSetMemoryLimits_v1"))
}
