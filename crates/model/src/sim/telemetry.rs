//! What a simulated machine's devices are doing: the telemetry file a test (or a demo) writes
//! and the fake NVML library answers its telemetry calls from, so a test can say "this PID uses
//! 3 GiB and 40% of GPU 0" and check where the agent reports it.
//!
//! JSON, `{"devices": {"<GPU or MIG UUID>": <DeviceTelemetry>}}`. A device that is not listed
//! reports [`DeviceTelemetry::default`]: idle, cool, nothing running. The file is only read,
//! never written, by the processes that serve it; writers replace it whole (write a temporary
//! file and rename it) so a reader never sees half a file.

use crate::telemetry::{ProcessUse, Readings};
use serde::Deserialize;
use std::collections::BTreeMap;

/// The whole telemetry file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TelemetryFile {
    /// Per device UUID (a whole GPU's `GPU-…` or a MIG device's `MIG-…`).
    #[serde(default)]
    pub devices: BTreeMap<String, DeviceTelemetry>,
}

/// One device's readings, as NVML's device queries return them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DeviceTelemetry {
    /// `nvmlDeviceGetUtilizationRates().gpu`: percent of the last sample period a kernel ran;
    /// on a MIG device of a Hopper or later GPU, its GPU instance's activity as GPM reports it
    /// (`nvmlGpmMigSampleGet`, NVML_GPM_METRIC_GRAPHICS_UTIL).
    pub gpu_util: u32,
    /// `nvmlDeviceGetUtilizationRates().memory`: percent of it device memory was read or written.
    pub memory_util: u32,
    /// Device memory in use; absent: the sum of [`Self::processes`]' memory.
    pub memory_used_bytes: Option<u64>,
    pub temperature_c: u32,
    pub power_milliwatts: u32,
    pub power_limit_milliwatts: u32,
    /// `nvmlDeviceGetCurrentClocksThrottleReasons`' bitmask (`0x1`: GPU idle, `0x4`: software
    /// power cap, `0x20`: software thermal slowdown, …).
    pub throttle_reasons: u64,
    /// Volatile ECC error counts (`nvmlDeviceGetTotalEccErrors`, `NVML_VOLATILE_ECC`).
    pub ecc_corrected: u64,
    pub ecc_uncorrected: u64,
    /// Pages retired for double-bit errors (`nvmlDeviceGetRetiredPages_v2`).
    pub retired_pages: u32,
    /// `nvmlDeviceGetPcieReplayCounter`.
    pub pcie_replays: u32,
    /// Every telemetry call on this device first waits this long, as a driver stuck on a
    /// failing GPU does.
    pub stall_ms: u64,
    /// Every telemetry call on this device answers `NVML_ERROR_UNKNOWN`.
    pub fail: bool,
    /// The PID of the MPS server serving this device's MPS clients (processes with `mps`).
    pub mps_server_pid: Option<u32>,
    pub processes: Vec<ProcessTelemetry>,
}

impl Default for DeviceTelemetry {
    fn default() -> Self {
        DeviceTelemetry {
            gpu_util: 0,
            memory_util: 0,
            memory_used_bytes: None,
            temperature_c: 35,
            power_milliwatts: 70_000,
            power_limit_milliwatts: 700_000,
            throttle_reasons: 0x1,
            ecc_corrected: 0,
            ecc_uncorrected: 0,
            retired_pages: 0,
            pcie_replays: 0,
            stall_ms: 0,
            fail: false,
            mps_server_pid: None,
            processes: Vec::new(),
        }
    }
}

/// A process with a compute context on the device.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProcessTelemetry {
    pub pid: u32,
    #[serde(default)]
    pub memory_bytes: u64,
    /// Percent of the device's SMs this process kept busy (`nvmlDeviceGetProcessUtilization`'s
    /// `smUtil`); absent: the process has no utilization sample.
    #[serde(default)]
    pub sm_util: Option<u32>,
    /// An MPS client: the work runs in the MPS server's context, so NVML lists it among the
    /// MPS compute processes (`nvmlDeviceGetMPSComputeRunningProcesses_v3`) and lists the
    /// server (`mps_server_pid`) among the compute processes instead.
    #[serde(default)]
    pub mps: bool,
}

impl DeviceTelemetry {
    /// Memory in use: as given, or what its processes use.
    pub fn memory_used(&self) -> u64 {
        self.memory_used_bytes
            .unwrap_or_else(|| self.processes.iter().map(|p| p.memory_bytes).sum())
    }

    /// What `nvmlDeviceGetComputeRunningProcesses_v3` lists: the processes with a context of
    /// their own, and the MPS server (with its clients' memory) where clients run.
    pub fn compute_processes(&self) -> Vec<(u32, u64)> {
        let mut listed: Vec<(u32, u64)> = self
            .processes
            .iter()
            .filter(|p| !p.mps)
            .map(|p| (p.pid, p.memory_bytes))
            .collect();
        let clients: Vec<&ProcessTelemetry> = self.processes.iter().filter(|p| p.mps).collect();
        if let (Some(server), false) = (self.mps_server_pid, clients.is_empty()) {
            listed.push((server, clients.iter().map(|p| p.memory_bytes).sum()));
        }
        listed
    }

    /// What `nvmlDeviceGetMPSComputeRunningProcesses_v3` lists: the MPS clients.
    pub fn mps_processes(&self) -> Vec<(u32, u64)> {
        self.processes
            .iter()
            .filter(|p| p.mps)
            .map(|p| (p.pid, p.memory_bytes))
            .collect()
    }
}

/// What kind of device answers, for the readings NVML offers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answering {
    /// A whole GPU; in MIG mode NVML offers no utilization counters and its process list is
    /// its MIG devices' (not read, so nothing is counted twice).
    Gpu { mig_mode: bool },
    /// A MIG device: memory and processes; utilization only where the GPU has GPM
    /// (`Gpu::has_gpm`); the board's facts are read on its GPU.
    MigDevice { gpm: bool },
}

impl DeviceTelemetry {
    /// The readings a driver would give for this device, whose memory is `memory_total_bytes`:
    /// what the fake NVML library answers, for the simulated source to answer the same.
    pub fn readings(&self, memory_total_bytes: u64, kind: Answering) -> Readings {
        let board = !matches!(kind, Answering::MigDevice { .. });
        let util = kind == Answering::Gpu { mig_mode: false };
        // GPM's activity of a MIG device's GPU instance, what the NVML backend reads there.
        let gpm = kind == Answering::MigDevice { gpm: true };
        let processes = kind != Answering::Gpu { mig_mode: true };
        let listed = if self.mps_processes().is_empty() {
            self.compute_processes()
        } else {
            self.mps_processes()
        };
        Readings {
            gpu_util_percent: (util || gpm).then_some(self.gpu_util),
            memory_util_percent: util.then_some(self.memory_util),
            memory_used_bytes: Some(self.memory_used().min(memory_total_bytes)),
            memory_total_bytes: Some(memory_total_bytes),
            temperature_celsius: board.then_some(self.temperature_c),
            power_milliwatts: board.then_some(self.power_milliwatts),
            power_limit_milliwatts: board.then_some(self.power_limit_milliwatts),
            throttle_reasons: board.then_some(self.throttle_reasons),
            ecc_corrected: board.then_some(self.ecc_corrected),
            ecc_uncorrected: board.then_some(self.ecc_uncorrected),
            retired_pages: board.then_some(u64::from(self.retired_pages)),
            pcie_replays: board.then_some(u64::from(self.pcie_replays)),
            processes: if processes {
                listed
                    .into_iter()
                    .map(|(pid, memory)| ProcessUse {
                        pid,
                        memory_bytes: Some(memory),
                        sm_util_percent: self
                            .processes
                            .iter()
                            .find(|p| p.pid == pid)
                            .and_then(|p| p.sm_util),
                    })
                    .collect()
            } else {
                Vec::new()
            },
        }
    }
}

/// Parses a telemetry file's text; `label` names it in the error.
pub fn parse(label: &str, text: &str) -> Result<TelemetryFile, String> {
    serde_json::from_str(text).map_err(|e| format!("telemetry file {label}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mps_clients_are_listed_apart_and_the_server_carries_their_memory() {
        let file = parse(
            "t.json",
            r#"{"devices": {"GPU-1": {"mpsServerPid": 9, "processes": [
                {"pid": 1, "memoryBytes": 10, "mps": true, "smUtil": 30},
                {"pid": 2, "memoryBytes": 5, "mps": true},
                {"pid": 3, "memoryBytes": 1}]}}}"#,
        )
        .unwrap();
        let d = &file.devices["GPU-1"];
        assert_eq!(d.compute_processes(), vec![(3, 1), (9, 15)]);
        assert_eq!(d.mps_processes(), vec![(1, 10), (2, 5)]);
        assert_eq!(d.memory_used(), 16);
        assert_eq!(d.temperature_c, 35, "unset fields take the defaults");
    }

    #[test]
    fn an_unknown_field_is_refused_naming_the_file() {
        let e = parse("t.json", r#"{"devices": {"GPU-1": {"gpuUtl": 3}}}"#).unwrap_err();
        assert!(e.contains("t.json") && e.contains("gpuUtl"), "{e}");
    }
}
