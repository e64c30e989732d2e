//! Direct calls into the loaded NVML library, for what `nvml-wrapper` 0.13 lacks or gets wrong.
//!
//! Every function looks its symbol up in the wrapper's already loaded library (`Nvml::lib`), so a
//! driver that lacks a call yields `FailedToLoadSymbol` instead of a crash. This file holds all
//! of the crate's unsafe code; everything else calls these safe functions.

use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t, nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstance_t, nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstance_t, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
};
use std::ptr;

/// An NVML event set, freed with [`free_event_set`] before NVML shuts down.
pub(super) struct RawEventSet(nvmlEventSet_t);

// SAFETY: an event set is an opaque token; NVML is documented thread-safe, so the token may be
// used from any thread, and this module never dereferences it.
unsafe impl Send for RawEventSet {}
// SAFETY: as above; shared use only passes the token to NVML.
unsafe impl Sync for RawEventSet {}

/// One event as NVML delivers it, with the device handle kept as an address (a map key).
#[derive(Debug, Clone, Copy)]
pub(super) struct RawEvent {
    pub device: usize,
    pub event_type: u64,
    pub data: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

/// The opaque handle behind a wrapper device.
pub(super) fn handle(device: &Device<'_>) -> nvmlDevice_t {
    // SAFETY: `handle` only reads the pointer NVML handed out; nothing dereferences it here.
    unsafe { device.handle() }
}

/// A wrapper device for a handle NVML gave us (in event data).
pub(super) fn device_at(nvml: &Nvml, address: usize) -> Device<'_> {
    let raw: nvmlDevice_t = ptr::with_exposed_provenance_mut(address);
    // SAFETY: the address is a device handle NVML itself returned (event data or a handle call),
    // and the wrapper only passes it back to NVML, which rejects unknown handles.
    unsafe { Device::new(raw, nvml) }
}

/// `nvmlDeviceGetGpuInstanceId` on a MIG device handle.
pub(super) fn gpu_instance_id(nvml: &Nvml, device: &Device<'_>) -> Result<u32, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref())?;
    let mut id = 0u32;
    // SAFETY: the symbol has nvml.h's signature (typed by the bindings), the handle came from
    // NVML, and `id` is a live out-parameter for the duration of the call.
    nvml_try(unsafe { sym(handle(device), &mut id) })?;
    Ok(id)
}

/// `nvmlDeviceGetComputeInstanceId` on a MIG device handle.
pub(super) fn compute_instance_id(nvml: &Nvml, device: &Device<'_>) -> Result<u32, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref())?;
    let mut id = 0u32;
    // SAFETY: as in `gpu_instance_id`.
    nvml_try(unsafe { sym(handle(device), &mut id) })?;
    Ok(id)
}

/// A GPU instance handle NVML gave us. Used within one call of the source; never stored.
pub(super) struct GpuInstance(nvmlGpuInstance_t);

/// A compute instance handle NVML gave us, likewise.
pub(super) struct ComputeInstance(nvmlComputeInstance_t);

/// `nvmlDeviceGetGpuInstanceById`.
pub(super) fn gpu_instance_by_id(
    nvml: &Nvml,
    parent: &Device<'_>,
    id: u32,
) -> Result<GpuInstance, NvmlError> {
    let by_id = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref())?;
    let mut instance: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: typed symbol, NVML-issued parent handle, live out-parameter.
    nvml_try(unsafe { by_id(handle(parent), id, &mut instance) })?;
    Ok(GpuInstance(instance))
}

/// `nvmlGpuInstanceGetInfo`: the instance's id, profile id and placement.
pub(super) fn gpu_instance_info(
    nvml: &Nvml,
    instance: &GpuInstance,
) -> Result<nvmlGpuInstanceInfo_t, NvmlError> {
    let get_info = nvml_sym(nvml.lib().nvmlGpuInstanceGetInfo.as_ref())?;
    let mut info = nvmlGpuInstanceInfo_t {
        device: ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvmlGpuInstancePlacement_t { start: 0, size: 0 },
    };
    // SAFETY: the instance handle came from NVML; `info` is a live, correctly laid out struct.
    nvml_try(unsafe { get_info(instance.0, &mut info) })?;
    Ok(info)
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` (the wrapper's version returns an empty
/// list: it never sets the length of the vector NVML filled).
pub(super) fn possible_placements(
    nvml: &Nvml,
    device: &Device<'_>,
    profile_id: u32,
) -> Result<Vec<nvmlGpuInstancePlacement_t>, NvmlError> {
    let sym = nvml_sym(
        nvml.lib()
            .nvmlDeviceGetGpuInstancePossiblePlacements_v2
            .as_ref(),
    )?;
    let mut count = 0u32;
    // SAFETY: typed symbol, NVML-issued handle; a null buffer asks for the count only.
    nvml_try(unsafe { sym(handle(device), profile_id, ptr::null_mut(), &mut count) })?;
    let mut placements = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    // SAFETY: `placements` holds `count` entries, which `count` tells NVML on the way in.
    nvml_try(unsafe {
        sym(
            handle(device),
            profile_id,
            placements.as_mut_ptr(),
            &mut count,
        )
    })?;
    placements.truncate(count as usize);
    Ok(placements)
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`.
pub(super) fn create_gpu_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    profile_id: u32,
    placement: &nvmlGpuInstancePlacement_t,
) -> Result<GpuInstance, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())?;
    let mut instance: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: typed symbol, NVML-issued handle, a live placement and out-parameter.
    nvml_try(unsafe { sym(handle(device), profile_id, placement, &mut instance) })?;
    Ok(GpuInstance(instance))
}

/// `nvmlGpuInstanceDestroy`.
pub(super) fn destroy_gpu_instance(nvml: &Nvml, instance: GpuInstance) -> Result<(), NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlGpuInstanceDestroy.as_ref())?;
    // SAFETY: typed symbol; the handle came from NVML and is not used after this call.
    nvml_try(unsafe { sym(instance.0) })
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfo` with the shared engine profile.
pub(super) fn compute_profile_info(
    nvml: &Nvml,
    instance: &GpuInstance,
    profile: u32,
) -> Result<nvmlComputeInstanceProfileInfo_t, NvmlError> {
    let sym = nvml_sym(
        nvml.lib()
            .nvmlGpuInstanceGetComputeInstanceProfileInfo
            .as_ref(),
    )?;
    let mut info = nvmlComputeInstanceProfileInfo_t {
        id: 0,
        sliceCount: 0,
        instanceCount: 0,
        multiprocessorCount: 0,
        sharedCopyEngineCount: 0,
        sharedDecoderCount: 0,
        sharedEncoderCount: 0,
        sharedJpegCount: 0,
        sharedOfaCount: 0,
    };
    let shared = NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED;
    // SAFETY: typed symbol, NVML-issued instance handle, live and correctly laid out struct.
    nvml_try(unsafe { sym(instance.0, profile, shared, &mut info) })?;
    Ok(info)
}

/// `nvmlGpuInstanceCreateComputeInstance`.
pub(super) fn create_compute_instance(
    nvml: &Nvml,
    instance: &GpuInstance,
    profile_id: u32,
) -> Result<ComputeInstance, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlGpuInstanceCreateComputeInstance.as_ref())?;
    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    // SAFETY: typed symbol, NVML-issued instance handle, live out-parameter.
    nvml_try(unsafe { sym(instance.0, profile_id, &mut ci) })?;
    Ok(ComputeInstance(ci))
}

/// `nvmlGpuInstanceGetComputeInstances` for one CI profile, whose `instanceCount` is `capacity`.
pub(super) fn compute_instances(
    nvml: &Nvml,
    instance: &GpuInstance,
    profile_id: u32,
    capacity: u32,
) -> Result<Vec<ComputeInstance>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlGpuInstanceGetComputeInstances.as_ref())?;
    let mut handles: Vec<nvmlComputeInstance_t> = vec![ptr::null_mut(); capacity as usize];
    let mut count = capacity;
    // SAFETY: typed symbol, NVML-issued instance handle; the buffer holds the profile's
    // instance count, as nvml.h requires.
    nvml_try(unsafe { sym(instance.0, profile_id, handles.as_mut_ptr(), &mut count) })?;
    handles.truncate(count as usize);
    Ok(handles.into_iter().map(ComputeInstance).collect())
}

/// `nvmlComputeInstanceGetInfo_v2`: the compute instance's id, profile id and placement.
pub(super) fn compute_instance_info(
    nvml: &Nvml,
    ci: &ComputeInstance,
) -> Result<nvmlComputeInstanceInfo_t, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlComputeInstanceGetInfo_v2.as_ref())?;
    let mut info = nvmlComputeInstanceInfo_t {
        device: ptr::null_mut(),
        gpuInstance: ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvmlComputeInstancePlacement_t { start: 0, size: 0 },
    };
    // SAFETY: typed symbol, NVML-issued handle, live and correctly laid out struct.
    nvml_try(unsafe { sym(ci.0, &mut info) })?;
    Ok(info)
}

/// `nvmlComputeInstanceDestroy`.
pub(super) fn destroy_compute_instance(nvml: &Nvml, ci: ComputeInstance) -> Result<(), NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlComputeInstanceDestroy.as_ref())?;
    // SAFETY: typed symbol; the handle came from NVML and is not used after this call.
    nvml_try(unsafe { sym(ci.0) })
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType` (the wrapper's version discards the answer).
pub(super) fn nvlink_remote_type(
    nvml: &Nvml,
    device: &Device<'_>,
    link: u32,
) -> Result<u32, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetNvLinkRemoteDeviceType.as_ref())?;
    let mut kind = 0u32;
    // SAFETY: typed symbol, NVML-issued handle, live out-parameter.
    nvml_try(unsafe { sym(handle(device), link, &mut kind) })?;
    Ok(kind)
}

/// `nvmlEventSetCreate`.
pub(super) fn create_event_set(nvml: &Nvml) -> Result<RawEventSet, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlEventSetCreate.as_ref())?;
    let mut set: nvmlEventSet_t = ptr::null_mut();
    // SAFETY: typed symbol, live out-parameter.
    nvml_try(unsafe { sym(&mut set) })?;
    Ok(RawEventSet(set))
}

/// `nvmlEventSetFree`; errors are of no use at that point and are ignored.
pub(super) fn free_event_set(nvml: &Nvml, set: &RawEventSet) {
    if let Ok(sym) = nvml_sym(nvml.lib().nvmlEventSetFree.as_ref()) {
        // SAFETY: the set came from `create_event_set` on this same library and is freed once,
        // from `NvmlSource::drop`.
        let _ = unsafe { sym(set.0) };
    }
}

/// `nvmlDeviceGetSupportedEventTypes`.
pub(super) fn supported_event_types(nvml: &Nvml, device: &Device<'_>) -> Result<u64, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetSupportedEventTypes.as_ref())?;
    let mut types = 0u64;
    // SAFETY: typed symbol, NVML-issued handle, live out-parameter.
    nvml_try(unsafe { sym(handle(device), &mut types) })?;
    Ok(types)
}

/// `nvmlDeviceRegisterEvents`.
pub(super) fn register_events(
    nvml: &Nvml,
    device: &Device<'_>,
    types: u64,
    set: &RawEventSet,
) -> Result<(), NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceRegisterEvents.as_ref())?;
    // SAFETY: typed symbol, NVML-issued handle and event set.
    nvml_try(unsafe { sym(handle(device), types, set.0) })
}

/// `nvmlEventSetWait_v2`: the next event, or `Timeout`.
pub(super) fn wait(nvml: &Nvml, set: &RawEventSet, timeout_ms: u32) -> Result<RawEvent, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlEventSetWait_v2.as_ref())?;
    let mut data = nvmlEventData_t {
        device: ptr::null_mut(),
        eventType: 0,
        eventData: 0,
        gpuInstanceId: u32::MAX,
        computeInstanceId: u32::MAX,
    };
    // SAFETY: typed symbol, NVML-issued event set, live and correctly laid out out-parameter.
    nvml_try(unsafe { sym(set.0, &mut data, timeout_ms) })?;
    Ok(RawEvent {
        device: data.device.expose_provenance(),
        event_type: data.eventType,
        data: data.eventData,
        gpu_instance_id: data.gpuInstanceId,
        compute_instance_id: data.computeInstanceId,
    })
}

/// `nvmlSetMemoryLimits_v1_t` (nvml.h, CUDA 13.4 / driver r615): a cgroup directory's path and
/// its soft and hard GPU memory limits in bytes.
#[repr(C)]
struct SetMemoryLimitsV1 {
    name_space: *const std::ffi::c_char,
    soft_limit: u64,
    hard_limit: u64,
}

/// `nvmlDeviceSetMemoryLimits_v1`'s signature.
type SetMemoryLimitsFn = unsafe extern "C" fn(
    nvmlDevice_t,
    *mut SetMemoryLimitsV1,
) -> nvml_wrapper_sys::bindings::nvmlReturn_t;

/// The name of the per-cgroup memory limit call, which `nvml-wrapper`'s bindings predate.
const SET_MEMORY_LIMITS: &[u8] = b"nvmlDeviceSetMemoryLimits_v1\0";

/// Whether `lib` (the NVML library, loaded again by path: the loader hands back the handle it
/// already has) exports `nvmlDeviceSetMemoryLimits_v1`.
pub(super) fn has_memory_limits(lib: &libloading::Library) -> bool {
    // SAFETY: only the symbol's presence is checked; the pointer is never called or read.
    unsafe { lib.get::<*const std::ffi::c_void>(SET_MEMORY_LIMITS) }.is_ok()
}

/// `nvmlDeviceSetMemoryLimits_v1`: limits the processes of cgroup directory `cgroup` to
/// `soft`/`hard` bytes of `device`'s memory.
pub(super) fn set_memory_limits(
    lib: &libloading::Library,
    device: &Device<'_>,
    cgroup: &std::ffi::CStr,
    soft: u64,
    hard: u64,
) -> Result<(), NvmlError> {
    // SAFETY: the symbol has nvml.h's r615 signature, declared above as `SetMemoryLimitsFn`.
    let sym = unsafe { lib.get::<SetMemoryLimitsFn>(SET_MEMORY_LIMITS) }
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let mut limits = SetMemoryLimitsV1 {
        name_space: cgroup.as_ptr(),
        soft_limit: soft,
        hard_limit: hard,
    };
    // SAFETY: NVML-issued handle; `limits` is laid out as nvml.h's struct and, with the path it
    // points to, lives for the whole call, which only reads it.
    nvml_try(unsafe { sym(handle(device), &mut limits) })
}

/// Loads the NVML library at `path` for a symbol `nvml-wrapper` lacks. The wrapper has loaded
/// the same file already, so the loader returns that handle and runs no initialiser again.
pub(super) fn open_library(
    path: &std::path::Path,
) -> Result<libloading::Library, libloading::Error> {
    // SAFETY: the library is NVIDIA's NVML (or its stand-in), already loaded and initialised in
    // this process by `nvml-wrapper`; loading it again only takes another reference.
    unsafe { libloading::Library::new(path) }
}

/// A GPM sample kept between sampling rounds (`gpm.rs`): a `GpmSample` borrows the `Nvml` it
/// came from, so it is kept as its handle and made a `GpmSample` again to be used or freed.
pub(super) struct RawGpmSample(nvml_wrapper_sys::bindings::nvmlGpmSample_t);

// SAFETY: a GPM sample is a buffer NVML fills and reads on the calls it is passed to, with no
// thread affinity; `gpm.rs` uses each from one thread at a time.
unsafe impl Send for RawGpmSample {}

/// Keeps `sample` past its borrow of `Nvml`; it must come back through [`gpm_sample`].
pub(super) fn keep_gpm_sample(sample: nvml_wrapper::gpm::GpmSample<'_>) -> RawGpmSample {
    RawGpmSample(sample.into_handle())
}

/// A kept sample as a `GpmSample` of `nvml` again (freed when dropped).
pub(super) fn gpm_sample(nvml: &Nvml, kept: RawGpmSample) -> nvml_wrapper::gpm::GpmSample<'_> {
    // SAFETY: `kept` came from `into_handle` of a sample of this same `nvml` (the source holds
    // one `Nvml` for its life) and is consumed here, so the handle has one owner again.
    unsafe { nvml_wrapper::gpm::GpmSample::from_handle(nvml, kept.0) }
}
