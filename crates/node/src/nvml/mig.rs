//! Dynamic MIG on the driver: creating a GPU instance and the compute instance spanning it, and
//! destroying both. nvml-wrapper 0.13 has no instance calls, so these go through `raw.rs`.
//!
//! Create: the profile's info for the table's `NVML_GPU_INSTANCE_PROFILE_*` index, the start
//! checked against NVML's possible placements, `nvmlDeviceCreateGpuInstanceWithPlacement`, the
//! compute-instance profile whose slices are the whole GPU instance's (shared engines),
//! `nvmlGpuInstanceCreateComputeInstance`, and the new MIG device read back exactly as
//! discovery reads MIG devices (`read::mig_devices`). A failure after the GPU instance exists
//! destroys what was created, so a refused or failed create leaves the GPU as it was.
//! Destroy: `nvmlDeviceGetGpuInstanceById`, each of its compute instances, then the instance.
//!
//! NVML's answers become [`MigChangeError`]s naming the call: a refusal of the hardware
//! (`INSUFFICIENT_RESOURCES`, `INVALID_ARGUMENT`, `NOT_SUPPORTED`) is `Refused`, an unknown GPU
//! or instance (`NOT_FOUND`) `NotFound`, anything else `Failed`.

use super::call::{self, describe};
use super::raw::{self, GpuInstance};
use super::read;
use crate::inventory::mig::{self, MigProfileSpec};
use crate::inventory::{DeviceUuid, MigDevice};
use crate::source::{MigChangeError, MigRequest};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES as INSUFFICIENT_RESOURCES,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
};

/// What was being done, for every error of one change: names the GPU and the instance.
struct Doing(String);

impl Doing {
    /// An NVML error of `call` as a [`MigChangeError`].
    fn error(&self, call: &str, e: NvmlError) -> MigChangeError {
        let refused = |why: &str| MigChangeError::Refused(format!("{}: {call}: {why}", self.0));
        match e {
            NvmlError::UnexpectedVariant(INSUFFICIENT_RESOURCES) => refused(
                "insufficient resources (the memory slices or engines it needs are taken by \
                 other instances)",
            ),
            NvmlError::InvalidArg => refused("invalid argument (the GPU does not allow it)"),
            NvmlError::NotSupported => {
                refused("not supported (is MIG mode on? nvidia-smi -i <gpu> -mig 1)")
            }
            NvmlError::NotFound => {
                MigChangeError::NotFound(format!("{}: {call}: not found (already gone?)", self.0))
            }
            e => MigChangeError::Failed {
                call: call.to_string(),
                reason: format!("{}: {}", self.0, describe(&e)),
            },
        }
    }

    fn call(&self, call: &'static str) -> impl FnOnce(NvmlError) -> MigChangeError + '_ {
        move |e| self.error(call, e)
    }

    fn refused(&self, why: impl std::fmt::Display) -> MigChangeError {
        MigChangeError::Refused(format!("{}: {why}", self.0))
    }
}

/// The GPU of a change; an unknown UUID is `NotFound`.
fn gpu<'n>(nvml: &'n Nvml, uuid: &DeviceUuid, doing: &Doing) -> Result<Device<'n>, MigChangeError> {
    nvml.device_by_uuid(uuid.as_str())
        .map_err(doing.call("nvmlDeviceGetHandleByUUID"))
}

/// `DeviceSource::create_mig` on NVML.
pub(super) fn create(nvml: &Nvml, req: &MigRequest) -> Result<MigDevice, MigChangeError> {
    let doing = Doing(format!(
        "creating MIG instance {} at memory slice {} on GPU {}",
        req.profile, req.start, req.gpu
    ));
    let device = gpu(nvml, &req.gpu, &doing)?;
    let product = device.name().map_err(doing.call("nvmlDeviceGetName"))?;
    let table = mig::catalogue_for_product(&product).ok_or_else(|| {
        doing.refused(format!(
            "no bundled MIG table for {product}, so its placement rules are unknown"
        ))
    })?;
    let spec = table.profile(&req.profile).ok_or_else(|| {
        doing.refused(format!(
            "no such profile in table {} (one of {})",
            table.name,
            table.profile_names().join(", ")
        ))
    })?;
    let gi = create_gpu_instance(nvml, &device, spec, req.start, &doing)?;
    match finish(nvml, &device, &req.gpu, &gi, &doing) {
        Ok(created) => Ok(created),
        Err(e) => {
            // Leave the GPU as it was: a half-made instance would hold its slices forever.
            if let Err(undo) = destroy_instance(nvml, gi, &doing) {
                tracing::warn!(
                    gpu = %req.gpu,
                    error = %undo,
                    "could not destroy the GPU instance of a failed create; destroy it with \
                     nvidia-smi mig -dci / -dgi"
                );
            }
            Err(e)
        }
    }
}

/// Creates the GPU instance of `spec` at `start`, after checking the start is one NVML allows.
fn create_gpu_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    spec: &MigProfileSpec,
    start: u32,
    doing: &Doing,
) -> Result<GpuInstance, MigChangeError> {
    let info = device
        .profile_info(spec.nvml_profile)
        .map_err(doing.call("nvmlDeviceGetGpuInstanceProfileInfo"))?;
    let placements = raw::possible_placements(nvml, device, info.id)
        .map_err(doing.call("nvmlDeviceGetGpuInstancePossiblePlacements_v2"))?;
    let Some(placement) = placements.iter().find(|p| p.start == start) else {
        let starts: Vec<u32> = placements.iter().map(|p| p.start).collect();
        return Err(doing.refused(format!(
            "{} cannot start at memory slice {start} (NVML allows {starts:?})",
            spec.name
        )));
    };
    raw::create_gpu_instance(nvml, device, info.id, placement)
        .map_err(doing.call("nvmlDeviceCreateGpuInstanceWithPlacement"))
}

/// Creates the compute instance spanning `gi` and reads the new MIG device back.
fn finish(
    nvml: &Nvml,
    device: &Device<'_>,
    parent: &DeviceUuid,
    gi: &GpuInstance,
    doing: &Doing,
) -> Result<MigDevice, MigChangeError> {
    let gi_info = raw::gpu_instance_info(nvml, gi).map_err(doing.call("nvmlGpuInstanceGetInfo"))?;
    let slices = device
        .profile_info(profile_index(device, gi_info.profileId, doing)?)
        .map_err(doing.call("nvmlDeviceGetGpuInstanceProfileInfo"))?
        .slice_count;
    let ci_profile = full_compute_profile(nvml, gi, slices, doing)?;
    let ci = raw::create_compute_instance(nvml, gi, ci_profile)
        .map_err(doing.call("nvmlGpuInstanceCreateComputeInstance"))?;
    let ci_info = raw::compute_instance_info(nvml, &ci)
        .map_err(doing.call("nvmlComputeInstanceGetInfo_v2"))?;
    let index = device.index().map_err(doing.call("nvmlDeviceGetIndex"))?;
    let total = device
        .memory_info()
        .map_err(doing.call("nvmlDeviceGetMemoryInfo_v2"))?
        .total;
    let listed = read::mig_devices(nvml, device, index, parent, total).map_err(|e| {
        MigChangeError::Failed {
            call: e.call.to_string(),
            reason: format!("{}: reading the new MIG device back: {}", doing.0, e.reason),
        }
    })?;
    listed
        .into_iter()
        .find(|m| m.gpu_instance_id == gi_info.id && m.compute_instance_id == ci_info.id)
        .ok_or_else(|| MigChangeError::Failed {
            call: "nvmlDeviceGetMigDeviceHandleByIndex".into(),
            reason: format!(
                "{}: GPU instance {} and compute instance {} were created but no MIG device \
                 lists them",
                doing.0, gi_info.id, ci_info.id
            ),
        })
}

/// The `NVML_GPU_INSTANCE_PROFILE_*` index of GPU-instance profile id `profile_id`.
fn profile_index(
    device: &Device<'_>,
    profile_id: u32,
    doing: &Doing,
) -> Result<u32, MigChangeError> {
    let profiles = call::instance_profiles(device).map_err(|e| MigChangeError::Failed {
        call: e.call.to_string(),
        reason: format!("{}: {}", doing.0, e.reason),
    })?;
    profiles
        .iter()
        .find(|(_, p)| p.id == profile_id)
        .map(|(i, _)| *i)
        .ok_or_else(|| MigChangeError::Failed {
            call: "nvmlDeviceGetGpuInstanceProfileInfo".into(),
            reason: format!(
                "{}: no profile index reports profile id {profile_id}",
                doing.0
            ),
        })
}

/// The id of the compute-instance profile that takes all `slices` of a GPU instance.
fn full_compute_profile(
    nvml: &Nvml,
    gi: &GpuInstance,
    slices: u32,
    doing: &Doing,
) -> Result<u32, MigChangeError> {
    for profile in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        match raw::compute_profile_info(nvml, gi, profile) {
            Ok(info) if info.sliceCount == slices => return Ok(info.id),
            Ok(_) | Err(NvmlError::NotSupported | NvmlError::InvalidArg) => {}
            Err(e) => return Err(doing.error("nvmlGpuInstanceGetComputeInstanceProfileInfo", e)),
        }
    }
    Err(doing.refused(format!(
        "no compute-instance profile spans the GPU instance's {slices} slices"
    )))
}

/// `DeviceSource::destroy_mig` on NVML.
pub(super) fn destroy(
    nvml: &Nvml,
    uuid: &DeviceUuid,
    gpu_instance_id: u32,
) -> Result<(), MigChangeError> {
    let doing = Doing(format!(
        "destroying GPU instance {gpu_instance_id} of GPU {uuid}"
    ));
    let device = gpu(nvml, uuid, &doing)?;
    let gi = raw::gpu_instance_by_id(nvml, &device, gpu_instance_id)
        .map_err(doing.call("nvmlDeviceGetGpuInstanceById"))?;
    destroy_instance(nvml, gi, &doing)
}

/// Destroys every compute instance of `gi`, then `gi`.
fn destroy_instance(nvml: &Nvml, gi: GpuInstance, doing: &Doing) -> Result<(), MigChangeError> {
    for profile in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let info = match raw::compute_profile_info(nvml, &gi, profile) {
            Ok(info) => info,
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => continue,
            Err(e) => return Err(doing.error("nvmlGpuInstanceGetComputeInstanceProfileInfo", e)),
        };
        let cis = raw::compute_instances(nvml, &gi, info.id, info.instanceCount)
            .map_err(doing.call("nvmlGpuInstanceGetComputeInstances"))?;
        for ci in cis {
            raw::destroy_compute_instance(nvml, ci)
                .map_err(doing.call("nvmlComputeInstanceDestroy"))?;
        }
    }
    raw::destroy_gpu_instance(nvml, gi).map_err(doing.call("nvmlGpuInstanceDestroy"))
}
