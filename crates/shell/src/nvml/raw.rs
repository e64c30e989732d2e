//! Direct calls into the loaded NVML library, for what `nvml-wrapper` 0.13 lacks or gets wrong.
//!
//! Every function looks its symbol up in the wrapper's already loaded library (`Nvml::lib`), so a
//! driver that lacks a call yields `FailedToLoadSymbol` instead of a crash. This file holds all
//! of the crate's unsafe code; everything else calls these safe functions.

use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlGpuInstanceInfo_t, nvmlGpuInstance_t,
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

/// Profile id and placement of GPU instance `id` on `parent`: `nvmlDeviceGetGpuInstanceById`
/// followed by `nvmlGpuInstanceGetInfo`.
pub(super) fn gpu_instance_info(
    nvml: &Nvml,
    parent: &Device<'_>,
    id: u32,
) -> Result<nvmlGpuInstanceInfo_t, NvmlError> {
    let by_id = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref())?;
    let get_info = nvml_sym(nvml.lib().nvmlGpuInstanceGetInfo.as_ref())?;
    let mut instance: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: typed symbol, NVML-issued parent handle, live out-parameter.
    nvml_try(unsafe { by_id(handle(parent), id, &mut instance) })?;
    let mut info = nvmlGpuInstanceInfo_t {
        device: ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvml_wrapper_sys::bindings::nvmlGpuInstancePlacement_t { start: 0, size: 0 },
    };
    // SAFETY: `instance` was just filled in by NVML; `info` is a live, correctly laid out struct.
    nvml_try(unsafe { get_info(instance, &mut info) })?;
    Ok(info)
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
