//! The real device source: NVIDIA's management library (NVML) read into the inventory model.
//!
//! [`NvmlSource`] loads `libnvidia-ml.so.1` through `nvml-wrapper` and keeps it loaded for its
//! whole life. `discover` reads every GPU, its MIG devices and the GPU-to-GPU wiring into an
//! [`Inventory`] field by field the way a simulation profile describes a machine, so the two can
//! be compared exactly (tests/nvml_fake.rs does, through the fake library in hack/fake-nvml). A
//! GPU whose queries fail — typically Xid 79, fallen off the bus — is listed in
//! [`Discovery::lost`] and every other GPU is still served. `next_event` waits on one NVML event
//! set for critical Xid errors and names the GPU and, where NVML attributes it, the MIG device.
//!
//! MIG profile names are derived the way NVIDIA's go-nvlib does (see `naming.rs`); which bundled
//! MIG table a GPU follows is `table.rs`, dynamic MIG (creating and destroying instances)
//! `mig.rs`, compute modes (read and set for MPS) `compute_mode.rs`, and per-cgroup memory limits (held
//! shares) `memory_limits.rs`. Calls the wrapper
//! lacks or gets wrong are made directly in `raw.rs`, the only unsafe code in the crate.

mod call;
mod compute_mode;
mod events;
mod gpm;
mod memory_limits;
mod mig;
mod naming;
#[allow(unsafe_code)]
mod raw;
mod read;
mod table;
mod telemetry;

use crate::inventory::{DeviceUuid, Inventory, MigDevice};
use crate::source::{
    ComputeMode, ComputeModeError, DeviceEvent, DeviceSource, Discovery, LostGpu, MigChangeError,
    MigRequest, SourceError,
};
use crate::telemetry::Readings;
pub use memory_limits::{set_cgroup_memory_limit, MemoryLimitError};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A [`DeviceSource`] backed by the NVIDIA driver (or anything exporting NVML's C API).
pub struct NvmlSource {
    nvml: Nvml,
    events: events::Events,
    /// The library, where the driver limits GPU memory per cgroup (`memory_limits.rs`).
    memory_limits: Option<PathBuf>,
    /// MIG devices' last GPM samples (`gpm.rs`).
    gpm: gpm::GpmSamples,
}

impl std::fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource").finish_non_exhaustive()
    }
}

/// The one-sentence error for a library that cannot be loaded or initialised.
fn open_error(lib_path: Option<&Path>, error: &NvmlError) -> SourceError {
    let hint = "run with --simulate <profile> to use a simulated machine without a GPU";
    let message = match (error, lib_path) {
        (NvmlError::LibloadingError(e), Some(p)) if p.exists() => format!(
            "the NVIDIA driver library (libnvidia-ml.so.1) at {} could not be loaded ({e}); \
             install a matching NVIDIA driver, or {hint}",
            p.display()
        ),
        (NvmlError::LibloadingError(_) | NvmlError::FailedToLoadSymbol(_), Some(p)) => format!(
            "no NVIDIA driver library (libnvidia-ml.so.1) was found at {}; install the NVIDIA \
             driver or point --nvml-lib at it, or {hint}",
            p.display()
        ),
        (NvmlError::LibloadingError(_) | NvmlError::FailedToLoadSymbol(_), None) => format!(
            "no NVIDIA driver library (libnvidia-ml.so.1) was found on the dynamic loader's \
             search path; install the NVIDIA driver or pass --nvml-lib, or {hint}"
        ),
        (e, path) => format!(
            "the NVIDIA driver library (libnvidia-ml.so.1{}) was found but NVML could not be \
             initialised ({}); check that the NVIDIA kernel driver is loaded, or {hint}",
            path.map(|p| format!(" at {}", p.display()))
                .unwrap_or_default(),
            call::describe(e)
        ),
    };
    SourceError::Unavailable(message)
}

fn query(call: &str) -> impl FnOnce(NvmlError) -> SourceError + '_ {
    move |e| SourceError::Query {
        call: call.to_string(),
        reason: call::describe(&e),
    }
}

impl NvmlSource {
    /// Loads NVML from `lib_path`, or from the loader's search path (`libnvidia-ml.so.1`), and
    /// registers every GPU that answers for critical Xid events.
    pub fn open(lib_path: Option<&Path>) -> Result<NvmlSource, SourceError> {
        let nvml = match lib_path {
            Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
            None => Nvml::init(),
        }
        .map_err(|e| {
            tracing::debug!(error = %e, "NVML initialisation failed");
            open_error(lib_path, &e)
        })?;
        let events = events::Events::new(&nvml);
        let lib = memory_limits::library_name(lib_path);
        let memory_limits = memory_limits::supported(&nvml, &lib).then_some(lib);
        let source = NvmlSource {
            nvml,
            events,
            memory_limits,
            gpm: gpm::GpmSamples::default(),
        };
        let count = source
            .nvml
            .device_count()
            .map_err(query("nvmlDeviceGetCount_v2"))?;
        for index in 0..count {
            let Ok(device) = source.nvml.device_by_index(index) else {
                continue;
            };
            if let Ok(uuid) = device.uuid() {
                source
                    .events
                    .ensure_registered(&source.nvml, index, &device, &uuid);
            }
        }
        Ok(source)
    }
}

impl Drop for NvmlSource {
    fn drop(&mut self) {
        // The event set and GPM samples must go before `nvml` shuts the library down.
        self.events.free(&self.nvml);
        self.gpm.free(&self.nvml);
    }
}

impl DeviceSource for NvmlSource {
    fn discover(&self) -> Result<Discovery, SourceError> {
        let nvml = &self.nvml;
        let driver_version = nvml
            .sys_driver_version()
            .map_err(query("nvmlSystemGetDriverVersion"))?;
        let cuda = nvml
            .sys_cuda_driver_version()
            .map_err(query("nvmlSystemGetCudaDriverVersion_v2"))?;
        let count = nvml
            .device_count()
            .map_err(query("nvmlDeviceGetCount_v2"))?;
        let mut answered = Vec::new();
        let mut lost = Vec::new();
        for index in 0..count {
            match read::gpu(nvml, index) {
                Ok(found) => {
                    self.events
                        .ensure_registered(nvml, index, &found.device, &found.gpu.uuid);
                    answered.push(found);
                }
                Err(e) => {
                    tracing::warn!(gpu = index, error = %e, "GPU does not answer; leaving it out");
                    self.events.forget_index(index);
                    lost.push(LostGpu {
                        index,
                        reason: e.to_string(),
                    });
                }
            }
        }
        let topology = read::topology(nvml, &answered);
        let inventory = Inventory {
            driver_version,
            cuda_driver_version: naming::cuda_version(cuda),
            gpus: answered.into_iter().map(|g| g.gpu).collect(),
            topology,
        };
        self.events.remember_mig_devices(&inventory);
        Ok(Discovery { inventory, lost })
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<DeviceEvent>, SourceError> {
        self.events.next(&self.nvml, timeout)
    }

    fn responds(&self, gpu_uuid: &str) -> bool {
        let Ok(device) = self.nvml.device_by_uuid(gpu_uuid) else {
            return false;
        };
        if device.memory_info().is_err() {
            return false;
        }
        // A GPU that answers again is registered for events again.
        if let Ok(index) = device.index() {
            self.events
                .ensure_registered(&self.nvml, index, &device, gpu_uuid);
        }
        true
    }

    fn sample(&self, uuid: &DeviceUuid) -> Result<Readings, SourceError> {
        telemetry::sample(&self.nvml, uuid, &self.gpm)
    }

    fn create_mig(&self, req: &MigRequest) -> Result<MigDevice, MigChangeError> {
        mig::create(&self.nvml, req)
    }

    fn destroy_mig(&self, gpu: &DeviceUuid, gpu_instance_id: u32) -> Result<(), MigChangeError> {
        mig::destroy(&self.nvml, gpu, gpu_instance_id)
    }

    fn compute_mode(&self, gpu: &DeviceUuid) -> Result<ComputeMode, ComputeModeError> {
        compute_mode::get(&self.nvml, gpu)
    }

    fn set_compute_mode(
        &self,
        gpu: &DeviceUuid,
        mode: ComputeMode,
    ) -> Result<(), ComputeModeError> {
        compute_mode::set(&self.nvml, gpu, mode)
    }

    fn memory_limit_library(&self) -> Option<PathBuf> {
        self.memory_limits.clone()
    }
}
