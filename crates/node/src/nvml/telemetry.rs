//! One device's telemetry through NVML: the readings of `gpuplane_model::telemetry`, each from
//! its documented query (NVIDIA NVML API reference, "Device Queries").
//!
//! A query NVML does not offer for this device (`NOT_SUPPORTED`, `NO_PERMISSION`, or a symbol
//! an older driver lacks) leaves its reading out; any other failure fails the whole sample, so
//! a device that stopped answering is reported down rather than half-read.
//!
//! A MIG device's utilization comes from GPM (`gpm.rs`), the only source NVML has for it.
//!
//! Processes: in MPS the clients' work runs in the MPS server's context, so
//! `nvmlDeviceGetComputeRunningProcesses` lists the server and
//! `nvmlDeviceGetMPSComputeRunningProcesses` the clients with their own memory (NVIDIA's MPS
//! documentation, "nvidia-smi" under Tools and Interface Reference, shows them as `M+C`). Where
//! clients are listed they are the processes and the server is left out: it holds the GPU's
//! only context in `EXCLUSIVE_PROCESS` mode, and charging its memory too would count the
//! clients' memory twice.

use super::call::describe;
use super::gpm::GpmSamples;
use crate::inventory::DeviceUuid;
use crate::source::SourceError;
use crate::telemetry::{ProcessUse, Readings};
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, RetirementCause, TemperatureSensor,
};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, Nvml};
use std::collections::BTreeMap;

/// `Ok(None)` for a reading the device does not offer; the named failure otherwise.
pub(super) fn offered<T>(
    call: &'static str,
    r: Result<T, NvmlError>,
) -> Result<Option<T>, SourceError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(
            NvmlError::NotSupported
            | NvmlError::NoPermission
            | NvmlError::FailedToLoadSymbol(_)
            | NvmlError::FunctionNotFound,
        ) => Ok(None),
        Err(e) => Err(SourceError::Query {
            call: call.into(),
            reason: describe(&e),
        }),
    }
}

/// Reads device `uuid` (a GPU or a MIG device). A GPU in MIG mode lists no processes: NVML's
/// list there is the sum of its MIG devices', which are read (and charged) one by one.
pub(super) fn sample(
    nvml: &Nvml,
    uuid: &DeviceUuid,
    gpm: &GpmSamples,
) -> Result<Readings, SourceError> {
    let d = nvml
        .device_by_uuid(uuid.as_str())
        .map_err(|e| SourceError::Query {
            call: "nvmlDeviceGetHandleByUUID".into(),
            reason: describe(&e),
        })?;
    // MIG mode is a whole GPU's (a MIG device's handle is refused the question).
    let mig_device = offered("nvmlDeviceIsMigDeviceHandle", d.mig_is_mig_device_handle())?;
    let processes = mig_device == Some(true)
        || offered("nvmlDeviceGetMigMode", d.mig_mode())?
            .is_none_or(|m| m.current != nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE);
    let util = offered("nvmlDeviceGetUtilizationRates", d.utilization_rates())?;
    let memory = offered("nvmlDeviceGetMemoryInfo_v2", d.memory_info())?;
    let ecc = |kind| {
        offered(
            "nvmlDeviceGetTotalEccErrors",
            d.total_ecc_errors(kind, EccCounter::Volatile),
        )
    };
    let mut readings = Readings {
        gpu_util_percent: util.as_ref().map(|u| u.gpu),
        memory_util_percent: util.as_ref().map(|u| u.memory),
        memory_used_bytes: memory.as_ref().map(|m| m.used),
        memory_total_bytes: memory.as_ref().map(|m| m.total),
        temperature_celsius: offered(
            "nvmlDeviceGetTemperature",
            d.temperature(TemperatureSensor::Gpu),
        )?,
        power_milliwatts: offered("nvmlDeviceGetPowerUsage", d.power_usage())?,
        power_limit_milliwatts: offered(
            "nvmlDeviceGetEnforcedPowerLimit",
            d.enforced_power_limit(),
        )?,
        throttle_reasons: offered(
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            d.current_throttle_reasons(),
        )?
        .map(|r| r.bits()),
        ecc_corrected: ecc(MemoryError::Corrected)?,
        ecc_uncorrected: ecc(MemoryError::Uncorrected)?,
        retired_pages: offered(
            "nvmlDeviceGetRetiredPages_v2",
            d.retired_pages(RetirementCause::DoubleBitEccError),
        )?
        .map(|p| p.len() as u64),
        pcie_replays: offered("nvmlDeviceGetPcieReplayCounter", d.pcie_replay_counter())?
            .map(u64::from),
        processes: Vec::new(),
    };
    if processes {
        readings.processes = processes_of(&d)?;
    }
    if mig_device == Some(true) && readings.gpu_util_percent.is_none() {
        readings.gpu_util_percent = gpm.mig_util(nvml, &d, uuid)?;
    }
    Ok(readings)
}

/// The device's compute processes with their memory and, where sampled, SM use.
fn processes_of(d: &Device<'_>) -> Result<Vec<ProcessUse>, SourceError> {
    let mps = offered(
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        d.mps_running_compute_processes(),
    )?
    .unwrap_or_default();
    let listed = if mps.is_empty() {
        offered(
            "nvmlDeviceGetComputeRunningProcesses_v3",
            d.running_compute_processes(),
        )?
        .unwrap_or_default()
    } else {
        mps
    };
    // No sample newer than the last one is NVML's NOT_FOUND: nothing ran since.
    let samples = match d.process_utilization_stats(None) {
        Err(NvmlError::NotFound) => Vec::new(),
        r => offered("nvmlDeviceGetProcessUtilization", r)?.unwrap_or_default(),
    };
    // Per PID, its newest sample.
    let mut sm: BTreeMap<u32, (u64, u32)> = BTreeMap::new();
    for s in samples {
        let e = sm.entry(s.pid).or_insert((s.timestamp, s.sm_util));
        if s.timestamp >= e.0 {
            *e = (s.timestamp, s.sm_util);
        }
    }
    Ok(listed
        .iter()
        .map(|p: &ProcessInfo| ProcessUse {
            pid: p.pid,
            memory_bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            },
            sm_util_percent: sm.get(&p.pid).map(|(_, u)| *u),
        })
        .collect())
}
