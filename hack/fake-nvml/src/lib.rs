//! A fake `libnvidia-ml.so` for tests: it serves a gpuplane simulation profile through NVML's C
//! ABI, so the real NVML code path (`gpuplane::nvml::NvmlSource` over `nvml-wrapper`) can be run
//! and compared field by field against `gpuplane_model::sim::load` — the very loader used here.
//!
//! # Environment (read by `nvmlInit_v2`; the machine is built when the first init finds none)
//!
//! * `GPUPLANE_FAKE_NVML_PROFILE` (required): a bundled profile name (`dgx-h100`, ...) or a
//!   profile file path. Missing or invalid: `nvmlInit_v2` fails with `NVML_ERROR_UNKNOWN`, the
//!   reason goes to stderr and `nvmlErrorString(NVML_ERROR_UNKNOWN)` returns it.
//! * `GPUPLANE_FAKE_NVML_CONTROL` (optional): a file the test appends command lines to. The fake
//!   reads the lines added since its last look on every NVML call (and every few milliseconds
//!   inside `nvmlEventSetWait_v2`); a partial last line waits for its newline.
//!
//! # Commands (one per line; blank lines and `#` comments ignored)
//!
//! * `xid <gpu-index> <code>` — a critical Xid on that GPU, delivered to every event set the GPU
//!   is registered in for `nvmlEventTypeXidCriticalError`.
//! * `xid <gpu-index> <code> <gpu-instance> <compute-instance>` — the same, attributed to a MIG
//!   device (event data carries the instance ids; otherwise they are `0xFFFFFFFF`).
//! * `lose <gpu-index>` — the GPU falls off the bus: Xid 79 is delivered, its event
//!   registrations are dropped, and every later call on it (handle lookups included) returns
//!   `NVML_ERROR_GPU_IS_LOST`.
//! * `restore <gpu-index>` — the GPU answers again (it must be registered for events anew).
//! * `init-fail` — until a later `init-ok` line, `nvmlInit_v2` fails with
//!   `NVML_ERROR_DRIVER_NOT_LOADED` (the kernel driver not loaded yet); read at every init that
//!   has no machine yet, so a test can hold a starting agent there and then let it through.
//!   Once initialised, both lines are no-ops.
//! * `GPUPLANE_FAKE_NVML_DRIVER_VERSION` (optional, fake-only): a driver version (`615.20.01`,
//!   2 to 4 dot-separated numbers; else `nvmlInit_v2` fails like a bad profile) reported instead
//!   of the profile's everywhere (`nvmlSystemGetDriverVersion`, `nvmlSystemGetNVMLVersion`), and
//!   deciding which driver's calls exist: the cgroup memory limits need 615 or newer.
//! * `GPUPLANE_FAKE_NVML_STATE` (optional): a file (conventionally next to the profile) where
//!   the MIG instances, the GPUs' compute modes and the cgroup memory limits are kept across
//!   processes. Without it each
//!   process's instances and modes live and die with it, as though the driver were reloaded at
//!   every start; with it, the instances one process created or destroyed and the modes it set
//!   are there for the next (read at the first `nvmlInit_v2` that builds a machine, written
//!   whole after every change; a missing file means the profile's instances and `DEFAULT`
//!   everywhere). The format is in `persist.rs`. Concurrent processes do not see each other's
//!   changes until they initialise again.
//! * `GPUPLANE_FAKE_NVML_TELEMETRY` (optional): a JSON telemetry file, the format
//!   `gpuplane_model::sim::telemetry` (`{"devices": {"<GPU- or MIG- UUID>": {...}}}`). Checked
//!   (modified time, length, inode) on every telemetry call and read again when changed; unset,
//!   missing, or a device not listed: `DeviceTelemetry::default()`. A file that does not parse
//!   is reported once on stderr and the last good content kept.
//!
//! # Telemetry (`telemetry.rs`)
//!
//! Answered from the device's entry: `nvmlDeviceGetUtilizationRates`,
//! `nvmlDeviceGetMemoryInfo` and `_v2` (`used` = `memory_used()` capped at the total),
//! `nvmlDeviceGetTemperature` (`NVML_TEMPERATURE_GPU` only), `nvmlDeviceGetPowerUsage`,
//! `nvmlDeviceGetEnforcedPowerLimit`, `nvmlDeviceGetCurrentClocksThrottleReasons`,
//! `nvmlDeviceGetTotalEccErrors` (volatile and aggregate alike), `nvmlDeviceGetRetiredPages`
//! and `_v2` (double-bit: made-up addresses and times; single-bit: none),
//! `nvmlDeviceGetPcieReplayCounter`, `nvmlDeviceGetComputeRunningProcesses_v3`,
//! `nvmlDeviceGetMPSComputeRunningProcesses_v3` and `nvmlDeviceGetProcessUtilization` (a sample
//! per process with `smUtil`, else `NVML_ERROR_NOT_FOUND`). Lists follow NVML's count-then-fill
//! protocol (`NVML_ERROR_INSUFFICIENT_SIZE` with the count for a null or short buffer).
//!
//! * MIG device handles answer `NVML_ERROR_NOT_SUPPORTED` to the whole-GPU facts (temperature,
//!   power, throttling, ECC, retired pages, PCIe replays); utilization and process utilization
//!   are `NVML_ERROR_NOT_SUPPORTED` on MIG handles and on GPUs in MIG mode, as on real NVML.
//! * Processes carry their MIG device's instance ids (else `0xFFFFFFFF`); a GPU in MIG mode
//!   lists its MIG devices' processes together.
//! * `stallMs`: the call waits that long before answering, outside the machine's lock, so calls
//!   on other devices go on meanwhile; `fail`: `NVML_ERROR_UNKNOWN`. Both are the handle's own
//!   entry's (a MIG device's, not its parent's), and come after the handle is resolved (a lost
//!   GPU: `NVML_ERROR_GPU_IS_LOST`) and after the refusals above, which answer at once.
//!
//! # Shape of the fake machine
//!
//! GPU, MIG device, GPU- and compute-instance handles and event sets are small tagged integers
//! cast to pointers, stable for the life of the process; MIG devices and instances are named by
//! their instance ids, so the handle of a destroyed one is invalid. MIG devices are handed out by
//! `nvmlDeviceGetMigDeviceHandleByIndex` in reverse instance order (clients must sort), with the
//! remaining slots up to the catalogue's compute slices answering `NVML_ERROR_NOT_FOUND`. On an
//! NVSwitch profile each GPU's links `0..nvlinks` (its model's count) are active with remote type
//! SWITCH and a made-up switch address in PCI domain `0xFFFF`; otherwise each direct link in the
//! profile takes that many consecutive link numbers on both GPUs, remote address = the peer.
//! GPUs without NVLinks answer `NVML_ERROR_NOT_SUPPORTED` to NVLink queries.
//!
//! # Dynamic MIG
//!
//! GPU and compute instances can be created and destroyed as on a real driver
//! (`nvmlDeviceGetGpuInstancePossiblePlacements_v2`, `nvmlDeviceCreateGpuInstanceWithPlacement`,
//! `nvmlGpuInstanceCreateComputeInstance`, `nvmlComputeInstanceDestroy`,
//! `nvmlGpuInstanceDestroy` and the listings and info calls around them). The placement rule,
//! the ids and the UUIDs are `gpuplane_model::sim::instances`, which the simulated source uses
//! too: GPU-instance ids are the smallest free id from 1, compute-instance ids 0, and a MIG
//! device's UUID is derived from its parent, its ids and the GPU's creation count, so a
//! re-created instance gets a new one. Only compute instances spanning their whole GPU instance
//! can be created (`compute.rs`). A created instance is listed by the MIG enumeration calls like
//! the profile's own.
//!
//! # Compute modes
//!
//! `nvmlDeviceGetComputeMode` and `nvmlDeviceSetComputeMode` keep one mode per GPU, `DEFAULT`
//! until set, through GPU handles only (MIG device handles: `NVML_ERROR_NOT_SUPPORTED`); the
//! details and NVML's words are in `compute_mode.rs`.
//!
//! # Cgroup memory limits (driver r615 and newer)
//!
//! `nvmlDeviceSetMemoryLimits_v1` (as root) and `nvmlDeviceGetMemoryLimits_v1` keep soft and
//! hard limits per GPU and cgroup directory, in the state file; a driver older than r615 answers
//! `NVML_ERROR_FUNCTION_NOT_FOUND`. For the fake MPS daemon, which caps its clients' memory at
//! their cgroup's hard limit as the driver caps allocations, this crate is also a Rust library:
//! [`cgroup_memory_limit`] reads the limit that applies to a cgroup, and tests write one with
//! [`record_memory_limit`]. The details and NVIDIA's words are in `memory_limits.rs`.
//!
//! No panic crosses the C boundary: every export runs inside `entry`, which catches unwinding.

#![deny(unsafe_op_in_unsafe_fn)]
// The exports keep NVML's C names; their safety contract is nvml.h's (valid out-pointers).
#![allow(non_snake_case)]

mod compute;
mod compute_mode;
mod device;
mod events;
mod gpm;
mod instances;
mod links;
mod memory_limits;
mod mig;
mod persist;
mod state;
mod system;
mod telemetry;
#[cfg(test)]
mod telemetry_tests;
#[cfg(test)]
mod tests;

pub use memory_limits::{cgroup_memory_limit, record_memory_limit, MEMORY_LIMIT_MAX};
pub use state::STATE_ENV;

use nvml_wrapper_sys::bindings::*;
use std::ffi::{c_char, c_uint, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub(crate) type Ret = nvmlReturn_t;
pub(crate) const SUCCESS: Ret = nvmlReturn_enum_NVML_SUCCESS;
pub(crate) const UNINITIALIZED: Ret = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
pub(crate) const INVALID_ARGUMENT: Ret = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
pub(crate) const NOT_SUPPORTED: Ret = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
pub(crate) const NOT_FOUND: Ret = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
pub(crate) const INSUFFICIENT_SIZE: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
pub(crate) const TIMEOUT: Ret = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
pub(crate) const GPU_IS_LOST: Ret = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
pub(crate) const ARGUMENT_VERSION_MISMATCH: Ret =
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
pub(crate) const UNKNOWN: Ret = nvmlReturn_enum_NVML_ERROR_UNKNOWN;
pub(crate) const DRIVER_NOT_LOADED: Ret = nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
pub(crate) const IN_USE: Ret = nvmlReturn_enum_NVML_ERROR_IN_USE;
pub(crate) const INSUFFICIENT_RESOURCES: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;

/// Runs an export's body, turning `Err(code)` and any panic into an NVML return code.
pub(crate) fn entry(body: impl FnOnce() -> Result<(), Ret>) -> Ret {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

/// Writes `value` through a caller's out-pointer.
///
/// # Safety
/// `out` must be null (rejected) or valid for a write of `T`, as nvml.h requires of callers.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) -> Result<(), Ret> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and, per this function's contract, valid for writes.
    unsafe { out.write(value) };
    Ok(())
}

/// Writes `values` to the start of a caller's array.
///
/// # Safety
/// `out` must be null (rejected) or valid for `values.len()` writes of `T`.
pub(crate) unsafe fn put_all<T: Copy>(out: *mut T, values: &[T]) -> Result<(), Ret> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    for (i, v) in values.iter().enumerate() {
        // SAFETY: non-null and, per this function's contract, valid for `values.len()` writes.
        unsafe { out.add(i).write(*v) };
    }
    Ok(())
}

/// Copies `text` and a NUL into a caller's buffer of `len` bytes.
///
/// # Safety
/// `buf` must be null (rejected) or valid for `len` bytes of writes.
pub(crate) unsafe fn put_str(buf: *mut c_char, len: c_uint, text: &str) -> Result<(), Ret> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = text.as_bytes();
    if bytes.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` is valid for `len` bytes and `bytes.len() + 1 <= len`; the regions cannot
    // overlap (one is ours, one the caller's).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Fills a fixed C string field (struct member), truncating to leave room for the NUL.
pub(crate) fn fill_chars<const N: usize>(field: &mut [c_char; N], text: &str) {
    let n = text.len().min(N.saturating_sub(1));
    for (dst, src) in field.iter_mut().zip(text.as_bytes()[..n].iter()) {
        *dst = *src as c_char;
    }
    if let Some(end) = field.get_mut(n) {
        *end = 0;
    }
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    entry(state::init)
}

#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    entry(state::init)
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    entry(state::shutdown)
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text: &'static CStr = catch_unwind(|| error_string(result)).unwrap_or(c"Unknown Error");
    text.as_ptr()
}

fn error_string(code: Ret) -> &'static CStr {
    if code == UNKNOWN {
        if let Some(reason) = state::init_error() {
            return reason;
        }
    }
    match code {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        TIMEOUT => c"Timeout",
        GPU_IS_LOST => c"GPU is lost",
        ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        DRIVER_NOT_LOADED => c"Driver Not Loaded",
        IN_USE => c"In use by another client",
        INSUFFICIENT_RESOURCES => c"Insufficient resources",
        memory_limits::NO_PERMISSION => c"Insufficient Permissions",
        memory_limits::FUNCTION_NOT_FOUND => c"Function Not Found",
        _ => c"Unknown Error",
    }
}
