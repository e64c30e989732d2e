//! Device telemetry as plain data: what one sampling round read from a device ([`Readings`]),
//! which container a process belongs to ([`cgroup`]), and the rows a scrape exports once each
//! device is labelled with its holders and each process's use is charged to its container
//! ([`attribute`]); which holds sit idle ([`idle`]) and how busy each was over time ([`busy`]).
//!
//! A reading NVML does not offer for a device (`NVML_ERROR_NOT_SUPPORTED`: utilization on a MIG
//! device, temperature of a MIG device, ECC on a board without it) is `None` and is not
//! exported; a device whose queries fail is [`Sample::Failed`] and is exported as down.

pub mod attribute;
pub mod busy;
pub mod cgroup;
pub mod idle;

use crate::inventory::DeviceUuid;

/// One device's readings in one round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Readings {
    /// Percent of the sample period a kernel ran (`nvmlDeviceGetUtilizationRates`).
    pub gpu_util_percent: Option<u32>,
    /// Percent of the sample period device memory was read or written.
    pub memory_util_percent: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub temperature_celsius: Option<u32>,
    pub power_milliwatts: Option<u32>,
    pub power_limit_milliwatts: Option<u32>,
    /// `nvmlClocksThrottleReasons` bitmask.
    pub throttle_reasons: Option<u64>,
    /// Volatile ECC error counts since the driver loaded.
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    /// Pages retired for double-bit ECC errors.
    pub retired_pages: Option<u64>,
    pub pcie_replays: Option<u64>,
    /// The processes with a compute context on the device (MPS clients, not their server).
    pub processes: Vec<ProcessUse>,
}

/// One process's use of a device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessUse {
    pub pid: u32,
    pub memory_bytes: Option<u64>,
    /// Percent of the device's SMs it kept busy, where NVML samples it.
    pub sm_util_percent: Option<u32>,
}

/// What asking one device gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sample {
    Answered(Readings),
    /// A query failed or did not return in time: the device is reported down, with why.
    Failed(String),
}

/// A device's latest sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSample {
    pub uuid: DeviceUuid,
    pub sample: Sample,
}
