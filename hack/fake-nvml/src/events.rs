//! Event sets: registration, and a wait that polls the control file until an event or timeout.

use crate::state::{with_fake, EventSet, Handle, XID};
use crate::{entry, put, INVALID_ARGUMENT, NOT_SUPPORTED, TIMEOUT};
use nvml_wrapper_sys::bindings::*;
use std::ffi::{c_uint, c_ulonglong};
use std::time::{Duration, Instant};

/// What every fake GPU can report: critical Xids and ECC errors.
const SUPPORTED: u64 =
    XID | nvmlEventTypeSingleBitEccError as u64 | nvmlEventTypeDoubleBitEccError as u64;
const POLL: Duration = Duration::from_millis(5);

fn set_id(set: nvmlEventSet_t) -> Result<u32, crate::Ret> {
    match Handle::of(set) {
        Some(Handle::EventSet(id)) => Ok(id),
        _ => Err(INVALID_ARGUMENT),
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    entry(|| {
        let id = with_fake(|f| {
            let id = f.next_set;
            f.next_set = f
                .next_set
                .checked_add(1)
                .filter(|n| *n <= 0xffff)
                .ok_or(crate::UNKNOWN)?;
            f.sets.insert(id, EventSet::default());
            Ok(id)
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(set, Handle::EventSet(id).ptr()) }
    })
}

#[no_mangle]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    entry(|| {
        let id = set_id(set)?;
        with_fake(|f| f.sets.remove(&id).map(|_| ()).ok_or(INVALID_ARGUMENT))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    entry(|| {
        with_fake(|f| f.gpu(device).map(|_| ()))?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(types, SUPPORTED) }
    })
}

#[no_mangle]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    entry(|| {
        let id = set_id(set)?;
        with_fake(|f| {
            let (gpu, _) = f.gpu(device)?;
            if types & !SUPPORTED != 0 {
                return Err(NOT_SUPPORTED);
            }
            let entry = f
                .sets
                .get_mut(&id)
                .ok_or(INVALID_ARGUMENT)?
                .registered
                .entry(gpu)
                .or_insert(0);
            *entry |= types;
            Ok(())
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let id = set_id(set)?;
        if data.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        loop {
            let next = with_fake(|f| {
                Ok(f.sets
                    .get_mut(&id)
                    .ok_or(INVALID_ARGUMENT)?
                    .queue
                    .pop_front())
            })?;
            if let Some(e) = next {
                let value = nvmlEventData_t {
                    device: Handle::Gpu(e.gpu).ptr(),
                    eventType: e.event_type,
                    eventData: e.data,
                    gpuInstanceId: e.gpu_instance,
                    computeInstanceId: e.compute_instance,
                };
                // SAFETY: non-null caller's out-pointer (nvml.h contract).
                return unsafe { put(data, value) };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TIMEOUT);
            }
            std::thread::sleep(POLL.min(deadline - now));
        }
    })
}
