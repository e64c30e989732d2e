//! GPM, GPU Performance Monitoring (nvml.h's `nvmlGpm*`, Hopper and later): a sample holds a
//! device's activity counters at one moment, and `nvmlGpmMetricsGet` turns two samples of the
//! same device into rates over the time between them. On a GPU in MIG mode, where
//! `nvmlDeviceGetUtilizationRates` answers NOT_SUPPORTED, `nvmlGpmMigSampleGet` samples one GPU
//! instance: the only utilization NVML offers for MIG.
//!
//! The fake keeps, per sampled device (a GPU, or the MIG device of a GPU instance), a counter
//! of active seconds that grows at the telemetry file's `gpuUtil` for that device between
//! samples; a metric between two samples is the counter's growth over their distance, so one
//! sample alone, or two of different devices, gives nothing, as on the hardware.

use crate::state::{with_fake, Dev, Fake};
use crate::{entry, put, Ret, ARGUMENT_VERSION_MISMATCH, INVALID_ARGUMENT, NOT_FOUND};
use crate::{NOT_SUPPORTED, SUCCESS, UNKNOWN};
use gpuplane_model::inventory::Gpu;
use nvml_wrapper_sys::bindings::*;
use std::collections::BTreeMap;
use std::ffi::c_uint;
use std::sync::Mutex;
use std::time::Instant;

const GRAPHICS_UTIL: c_uint = nvmlGpmMetricId_t_NVML_GPM_METRIC_GRAPHICS_UTIL;
const SM_UTIL: c_uint = nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_UTIL;

/// What one sample holds once taken: the device, when, and its active seconds then.
#[derive(Clone)]
struct Taken {
    device: String,
    at: Instant,
    active: f64,
}

/// The samples handed out (by address) and each device's activity counter.
struct Gpm {
    samples: BTreeMap<usize, Option<Taken>>,
    /// Per device UUID: when its counter was last moved, and its active seconds.
    counters: BTreeMap<String, (Instant, f64)>,
}

static GPM: Mutex<Gpm> = Mutex::new(Gpm {
    samples: BTreeMap::new(),
    counters: BTreeMap::new(),
});

fn gpm() -> std::sync::MutexGuard<'static, Gpm> {
    GPM.lock().unwrap_or_else(|p| p.into_inner())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(
    device: nvmlDevice_t,
    support: *mut nvmlGpmSupport_t,
) -> nvmlReturn_t {
    entry(|| {
        if support.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null caller's struct (nvml.h contract); its version is the caller's.
        if unsafe { (*support).version } != NVML_GPM_SUPPORT_VERSION {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let ok = with_fake(|f| match f.dev(device)? {
            Dev::Gpu(_, g) => Ok(g.has_gpm()),
            Dev::Mig(..) => Err(INVALID_ARGUMENT),
        })?;
        let answer = nvmlGpmSupport_t {
            version: NVML_GPM_SUPPORT_VERSION,
            isSupportedDevice: c_uint::from(ok),
        };
        // SAFETY: checked non-null above.
        unsafe { put(support, answer) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(sample: *mut nvmlGpmSample_t) -> nvmlReturn_t {
    entry(|| {
        let handle = Box::into_raw(Box::new(0u8)) as usize;
        gpm().samples.insert(handle, None);
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(sample, handle as nvmlGpmSample_t) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleFree(sample: nvmlGpmSample_t) -> nvmlReturn_t {
    entry(|| {
        let handle = sample as usize;
        gpm().samples.remove(&handle).ok_or(INVALID_ARGUMENT)?;
        // SAFETY: allocated by nvmlGpmSampleAlloc as a Box<u8> and removed from the live set
        // just now, so freed once.
        drop(unsafe { Box::from_raw(sample.cast::<u8>()) });
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleGet(
    device: nvmlDevice_t,
    sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    entry(|| {
        let (uuid, util, fail) = with_fake(|f| {
            let g = gpm_gpu(f, device)?;
            Ok(activity(f, g.uuid.as_str()))
        })?;
        take(sample, uuid, util, fail)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmMigSampleGet(
    device: nvmlDevice_t,
    gpu_instance_id: c_uint,
    sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    entry(|| {
        let (uuid, util, fail) = with_fake(|f| {
            let g = gpm_gpu(f, device)?;
            if !g.mig.current {
                return Err(INVALID_ARGUMENT);
            }
            // The GPU instance's activity: its (first) MIG device's entry.
            let mig = g
                .mig_devices
                .iter()
                .find(|m| m.gpu_instance_id == gpu_instance_id)
                .ok_or(NOT_FOUND)?;
            Ok(activity(f, mig.uuid.as_str()))
        })?;
        take(sample, uuid, util, fail)
    })
}

/// The GPU a GPM sample is taken on: a whole GPU's handle, of a GPU with GPM.
fn gpm_gpu(f: &Fake, device: nvmlDevice_t) -> Result<Gpu, Ret> {
    match f.dev(device)? {
        Dev::Gpu(_, g) if g.has_gpm() => Ok(g.clone()),
        Dev::Gpu(..) => Err(NOT_SUPPORTED),
        Dev::Mig(..) => Err(INVALID_ARGUMENT),
    }
}

/// Device `uuid`'s activity now, from the telemetry file: (uuid, percent, failing).
fn activity(f: &mut Fake, uuid: &str) -> (String, u32, bool) {
    f.telemetry.refresh();
    let own = f.telemetry.device(uuid);
    (uuid.to_string(), own.gpu_util, own.fail)
}

/// Moves `device`'s counter to now at `util` percent since its last move and records it in
/// `sample`.
fn take(sample: nvmlGpmSample_t, device: String, util: u32, fail: bool) -> Result<(), Ret> {
    if fail {
        return Err(UNKNOWN);
    }
    let mut g = gpm();
    if !g.samples.contains_key(&(sample as usize)) {
        return Err(INVALID_ARGUMENT);
    }
    let now = Instant::now();
    let (last, active) = g.counters.get(&device).copied().unwrap_or((now, 0.0));
    let active = active + f64::from(util.min(100)) / 100.0 * now.duration_since(last).as_secs_f64();
    g.counters.insert(device.clone(), (now, active));
    g.samples.insert(
        sample as usize,
        Some(Taken {
            device,
            at: now,
            active,
        }),
    );
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmMetricsGet(request: *mut nvmlGpmMetricsGet_t) -> nvmlReturn_t {
    entry(|| {
        if request.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null caller's struct (nvml.h contract), read and written in place.
        let r = unsafe { &mut *request };
        if r.version != NVML_GPM_METRICS_GET_VERSION {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let n = r.numMetrics as usize;
        if n > r.metrics.len() {
            return Err(INVALID_ARGUMENT);
        }
        let g = gpm();
        let taken = |s: nvmlGpmSample_t| g.samples.get(&(s as usize)).cloned().flatten();
        let (Some(a), Some(b)) = (taken(r.sample1), taken(r.sample2)) else {
            return Err(INVALID_ARGUMENT);
        };
        let span = b.at.saturating_duration_since(a.at).as_secs_f64();
        if a.device != b.device || span <= 0.0 {
            return Err(INVALID_ARGUMENT);
        }
        let busy = ((b.active - a.active) / span * 100.0).clamp(0.0, 100.0);
        for m in &mut r.metrics[..n] {
            (m.nvmlReturn, m.value) = match m.metricId {
                GRAPHICS_UTIL | SM_UTIL => (SUCCESS, busy),
                _ => (NOT_SUPPORTED, 0.0),
            };
        }
        Ok(())
    })
}
