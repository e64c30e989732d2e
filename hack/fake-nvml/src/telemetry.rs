//! The telemetry calls (utilization, memory in use, temperature, power, throttling, ECC, retired
//! pages, PCIe replays, running processes), answered from the telemetry file named by
//! `GPUPLANE_FAKE_NVML_TELEMETRY`, whose format and parser are
//! `gpuplane_model::sim::telemetry`. The file is looked at (metadata only) on every call and
//! read again when it changed, so a test steers a running agent by rewriting it.
//!
//! A device's `stallMs` is served after the machine's lock is released: a driver stuck on one
//! GPU must not hold up the calls other threads make on other GPUs (discovery, Allocate).

use crate::state::{with_fake, Dev, NO_INSTANCE};
use crate::{entry, put, put_all, Ret, INSUFFICIENT_SIZE, INVALID_ARGUMENT, NOT_FOUND};
use crate::{NOT_SUPPORTED, UNKNOWN};
use gpuplane_model::sim::telemetry::{parse, DeviceTelemetry, TelemetryFile};
use nvml_wrapper_sys::bindings::*;
use std::ffi::{c_uint, c_ulonglong};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub(crate) const TELEMETRY_ENV: &str = "GPUPLANE_FAKE_NVML_TELEMETRY";

const CORRECTED: nvmlMemoryErrorType_t = nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED;
const UNCORRECTED: nvmlMemoryErrorType_t =
    nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED;
const VOLATILE: nvmlEccCounterType_t = nvmlEccCounterType_enum_NVML_VOLATILE_ECC;
const AGGREGATE: nvmlEccCounterType_t = nvmlEccCounterType_enum_NVML_AGGREGATE_ECC;
const SINGLE_BIT: nvmlPageRetirementCause_t =
    nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS;
const DOUBLE_BIT: nvmlPageRetirementCause_t =
    nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR;
const GPU_SENSOR: nvmlTemperatureSensors_t = nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU;

/// Made-up retired page addresses and retirement times (seconds since the epoch), fixed so that
/// repeated reads agree.
const FIRST_PAGE: u64 = 0x1_0000_0000;
const PAGE: u64 = 0x1000;
const FIRST_RETIREMENT: u64 = 1_700_000_000;

/// Which version of the file was last read: a rewrite (modified time, length) or a replacement
/// by rename (inode, as writers are told to do) shows as a different stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

/// The telemetry file and its last good content; part of the machine, so a new `nvmlInit_v2`
/// after the last shutdown reads the environment again.
pub(crate) struct Telemetry {
    path: Option<PathBuf>,
    /// The version last read, good or bad: an unchanged file is not read again, so a bad one is
    /// reported once.
    seen: Option<Stamp>,
    file: TelemetryFile,
    /// What an unlisted device reports.
    idle: DeviceTelemetry,
}

impl Telemetry {
    pub(crate) fn from_env() -> Telemetry {
        Telemetry {
            path: std::env::var_os(TELEMETRY_ENV).map(PathBuf::from),
            seen: None,
            file: TelemetryFile::default(),
            idle: DeviceTelemetry::default(),
        }
    }

    /// Reads the file again if it changed since the last look.
    pub(crate) fn refresh(&mut self) {
        let Some(path) = &self.path else {
            return;
        };
        let Ok(meta) = std::fs::metadata(path) else {
            // Gone (or never there): every device is idle again.
            self.seen = None;
            self.file = TelemetryFile::default();
            return;
        };
        let stamp = Stamp {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode: std::os::unix::fs::MetadataExt::ino(&meta),
        };
        if self.seen == Some(stamp) {
            return;
        }
        self.seen = Some(stamp);
        let label = path.display().to_string();
        let parsed = std::fs::read_to_string(path)
            .map_err(|e| format!("telemetry file {label}: {e}"))
            .and_then(|text| parse(&label, &text));
        match parsed {
            Ok(file) => self.file = file,
            Err(why) => {
                let _ = writeln!(
                    std::io::stderr(),
                    "fake NVML: {why}; keeping the last good telemetry"
                );
            }
        }
    }

    pub(crate) fn device(&self, uuid: &str) -> &DeviceTelemetry {
        self.file.devices.get(uuid).unwrap_or(&self.idle)
    }
}

/// Answers a telemetry call on `device`. Under the machine's lock: the handle is resolved (a
/// lost GPU answers `NVML_ERROR_GPU_IS_LOST`), the file refreshed and `pick` makes the answer
/// from the device, its own entry and the whole file; a refusal from `pick` (a call the device
/// does not support) comes at once, as the driver knows it without asking the GPU. Then,
/// outside the lock, the entry's stall is served and its `fail` answered.
fn serve<R>(
    device: nvmlDevice_t,
    pick: impl FnOnce(&Dev<'_>, &DeviceTelemetry, &Telemetry) -> Result<R, Ret>,
) -> Result<R, Ret> {
    let (stall_ms, fail, answer) = with_fake(|f| {
        f.telemetry.refresh();
        let dev = f.dev(device)?;
        let uuid = match &dev {
            Dev::Gpu(_, g) => g.uuid.as_str(),
            Dev::Mig(_, _, m) => m.uuid.as_str(),
        };
        let own = f.telemetry.device(uuid);
        let answer = pick(&dev, own, &f.telemetry)?;
        Ok((own.stall_ms, own.fail, answer))
    })?;
    if stall_ms > 0 {
        stalling::begin();
        std::thread::sleep(Duration::from_millis(stall_ms));
        stalling::end();
    }
    if fail {
        return Err(UNKNOWN);
    }
    Ok(answer)
}

/// Refuses MIG device handles: the whole-GPU facts are read on the parent.
fn whole_gpu(dev: &Dev<'_>) -> Result<(), Ret> {
    match dev {
        Dev::Gpu(..) => Ok(()),
        Dev::Mig(..) => Err(NOT_SUPPORTED),
    }
}

/// Refuses MIG device handles and GPUs in MIG mode, where NVML keeps no utilization counters.
fn mig_off(dev: &Dev<'_>) -> Result<(), Ret> {
    match dev {
        Dev::Gpu(_, g) if !g.mig.current => Ok(()),
        _ => Err(NOT_SUPPORTED),
    }
}

/// `(total, used)` bytes for `nvmlDeviceGetMemoryInfo` and `_v2` (`device.rs`).
pub(crate) fn memory(device: nvmlDevice_t) -> Result<(u64, u64), Ret> {
    serve(device, |dev, own, _| {
        let total = match dev {
            Dev::Gpu(_, g) => g.memory_mib << 20,
            Dev::Mig(_, _, m) => m.memory_mib << 20,
        };
        Ok((total, own.memory_used().min(total)))
    })
}

/// Serves a scalar whole-GPU reading through an out-pointer.
///
/// # Safety
/// `out` must be null (rejected) or valid for a write of `T`.
unsafe fn scalar<T>(
    device: nvmlDevice_t,
    out: *mut T,
    read: impl FnOnce(&DeviceTelemetry) -> T,
) -> Ret {
    entry(|| {
        let value = serve(device, |dev, own, _| {
            whole_gpu(dev)?;
            Ok(read(own))
        })?;
        // SAFETY: per this function's contract.
        unsafe { put(out, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    entry(|| {
        let value = serve(device, |dev, own, _| {
            mig_off(dev)?;
            Ok(nvmlUtilization_t {
                gpu: own.gpu_util,
                memory: own.memory_util,
            })
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(utilization, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    if sensor != GPU_SENSOR {
        // The GPU die is the only sensor nvml.h names.
        return INVALID_ARGUMENT;
    }
    // SAFETY: caller\'s out-pointer (nvml.h contract).
    unsafe { scalar(device, temp, |t| t.temperature_c) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    power: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: caller\'s out-pointer (nvml.h contract).
    unsafe { scalar(device, power, |t| t.power_milliwatts) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: caller\'s out-pointer (nvml.h contract).
    unsafe { scalar(device, limit, |t| t.power_limit_milliwatts) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> nvmlReturn_t {
    // SAFETY: caller\'s out-pointer (nvml.h contract).
    unsafe { scalar(device, reasons, |t| t.throttle_reasons) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPcieReplayCounter(
    device: nvmlDevice_t,
    value: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: caller\'s out-pointer (nvml.h contract).
    unsafe { scalar(device, value, |t| t.pcie_replays) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    error_type: nvmlMemoryErrorType_t,
    counter_type: nvmlEccCounterType_t,
    count: *mut c_ulonglong,
) -> nvmlReturn_t {
    if !matches!(error_type, CORRECTED | UNCORRECTED)
        || !matches!(counter_type, VOLATILE | AGGREGATE)
    {
        return INVALID_ARGUMENT;
    }
    // The file has one count per type; the aggregate (lifetime) count is the volatile one, as
    // on a GPU whose driver was never reloaded.
    // SAFETY: caller's out-pointer (nvml.h contract).
    unsafe {
        scalar(device, count, |t| match error_type {
            CORRECTED => t.ecc_corrected,
            _ => t.ecc_uncorrected,
        })
    }
}

/// The pages retired for `cause`: `(address, timestamp)`.
fn retired(device: nvmlDevice_t, cause: nvmlPageRetirementCause_t) -> Result<Vec<(u64, u64)>, Ret> {
    if !matches!(cause, SINGLE_BIT | DOUBLE_BIT) {
        return Err(INVALID_ARGUMENT);
    }
    serve(device, |dev, own, _| {
        whole_gpu(dev)?;
        // The file counts double-bit retirements only.
        let n = if cause == DOUBLE_BIT {
            u64::from(own.retired_pages)
        } else {
            0
        };
        Ok((0..n)
            .map(|i| (FIRST_PAGE + i * PAGE, FIRST_RETIREMENT + i * 60))
            .collect())
    })
}

/// NVML's count-then-fill protocol: `*count` holds the buffer's capacity on entry and the number
/// of entries on return; a null or short buffer answers `NVML_ERROR_INSUFFICIENT_SIZE` (none to
/// list: `NVML_SUCCESS`, whatever the buffer).
///
/// # Safety
/// `count` must be null (rejected) or valid for a read and a write; `buf` null or valid for
/// `*count` writes of `T`.
unsafe fn fill<T: Copy>(count: *mut c_uint, buf: *mut T, items: &[T]) -> Result<(), Ret> {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and, per this function's contract, valid for a read.
    let capacity = unsafe { count.read() };
    let n = c_uint::try_from(items.len()).map_err(|_| UNKNOWN)?;
    // SAFETY: as above, valid for a write.
    unsafe { count.write(n) };
    if n == 0 {
        return Ok(());
    }
    if buf.is_null() || capacity < n {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` holds `capacity >= n` entries, per this function's contract.
    unsafe { put_all(buf, items) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages(
    device: nvmlDevice_t,
    cause: nvmlPageRetirementCause_t,
    page_count: *mut c_uint,
    addresses: *mut c_ulonglong,
) -> nvmlReturn_t {
    // nvml-wrapper counts the pages with this older call before reading them with `_v2`.
    entry(|| {
        let pages: Vec<u64> = retired(device, cause)?.iter().map(|p| p.0).collect();
        // SAFETY: caller's count and buffer of `*page_count` entries (nvml.h contract).
        unsafe { fill(page_count, addresses, &pages) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages_v2(
    device: nvmlDevice_t,
    cause: nvmlPageRetirementCause_t,
    page_count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> nvmlReturn_t {
    entry(|| {
        let pages = retired(device, cause)?;
        let addrs: Vec<u64> = pages.iter().map(|p| p.0).collect();
        // SAFETY: caller's count and buffer of `*page_count` entries (nvml.h contract).
        unsafe { fill(page_count, addresses, &addrs) }?;
        // nvml.h makes the timestamps optional; `fill` left `*page_count` at the page count,
        // which fits the caller's buffers.
        if !timestamps.is_null() {
            let times: Vec<u64> = pages.iter().map(|p| p.1).collect();
            // SAFETY: the caller's buffer has room for as many entries as `addresses`.
            unsafe { put_all(timestamps, &times) }?;
        }
        Ok(())
    })
}

fn process(pid: u32, memory: u64, gi: u32, ci: u32) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid,
        usedGpuMemory: memory,
        gpuInstanceId: gi,
        computeInstanceId: ci,
    }
}

/// A process listing: the device's own, or on a whole GPU in MIG mode its MIG devices' together
/// with their instance ids (NVML's aggregate view; no process has a context on the whole GPU
/// then, so the GPU's own entry is not listed).
fn processes(
    device: nvmlDevice_t,
    list: fn(&DeviceTelemetry) -> Vec<(u32, u64)>,
) -> Result<Vec<nvmlProcessInfo_t>, Ret> {
    serve(device, |dev, own, all| {
        let tagged = |t: &DeviceTelemetry, gi: u32, ci: u32| {
            list(t)
                .into_iter()
                .map(move |(pid, memory)| process(pid, memory, gi, ci))
        };
        Ok(match dev {
            Dev::Gpu(_, g) if g.mig.current => g
                .mig_devices
                .iter()
                .flat_map(|m| {
                    let t = all.device(m.uuid.as_str());
                    tagged(t, m.gpu_instance_id, m.compute_instance_id)
                })
                .collect(),
            Dev::Gpu(..) => tagged(own, NO_INSTANCE, NO_INSTANCE).collect(),
            Dev::Mig(_, _, m) => tagged(own, m.gpu_instance_id, m.compute_instance_id).collect(),
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let listed = processes(device, DeviceTelemetry::compute_processes)?;
        // SAFETY: caller's count and buffer of `*info_count` entries (nvml.h contract).
        unsafe { fill(info_count, infos, &listed) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let listed = processes(device, DeviceTelemetry::mps_processes)?;
        // SAFETY: caller's count and buffer of `*info_count` entries (nvml.h contract).
        unsafe { fill(info_count, infos, &listed) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    samples: *mut c_uint,
    last_seen: c_ulonglong,
) -> nvmlReturn_t {
    entry(|| {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let listed: Vec<nvmlProcessUtilizationSample_t> = serve(device, |dev, own, _| {
            mig_off(dev)?;
            Ok(own
                .processes
                .iter()
                .filter_map(|p| {
                    p.sm_util.map(|sm| nvmlProcessUtilizationSample_t {
                        pid: p.pid,
                        timeStamp: now,
                        smUtil: sm,
                        memUtil: 0,
                        encUtil: 0,
                        decUtil: 0,
                    })
                })
                .collect())
        })?;
        // Every sample is taken now: none is newer than a `last_seen` from now or later.
        if listed.is_empty() || last_seen >= now {
            // SAFETY: caller's out-pointer (nvml.h contract).
            unsafe { put(samples, 0) }?;
            return Err(NOT_FOUND);
        }
        // SAFETY: caller's count and buffer of `*samples` entries (nvml.h contract).
        unsafe { fill(samples, utilization, &listed) }
    })
}

/// How many calls are inside a stall right now, for the test that checks other calls go on
/// meanwhile (an ordering check needs an event, not a clock).
#[cfg(test)]
pub(crate) mod stalling {
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub(crate) static NOW: AtomicUsize = AtomicUsize::new(0);

    pub(super) fn begin() {
        NOW.fetch_add(1, Ordering::SeqCst);
    }

    pub(super) fn end() {
        NOW.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(not(test))]
mod stalling {
    pub(super) fn begin() {}
    pub(super) fn end() {}
}
