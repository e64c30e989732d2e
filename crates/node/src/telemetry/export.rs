//! The telemetry families, encoded at scrape time from what the samplers last stored: no
//! series outlives its device or holder, and the series count is bounded by devices times
//! the containers holding them (never PIDs).
//!
//! Every series carries the device (`uuid`, `gpu`, `mig_profile`) and its holder (`api`,
//! `namespace`, `pod`, `container`, `claim`, `share`; empty where none or shared). Ratios are
//! 0..1, power in watts, memory in bytes (Prometheus' base units).

use super::attribute::{Attributed, DeviceLabels, Hold};
use super::{Readings, Sample};
use crate::metrics;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct Series {
    uuid: String,
    gpu: String,
    mig_profile: String,
    api: String,
    namespace: String,
    pod: String,
    container: String,
    claim: String,
    share: String,
}

fn series(d: &DeviceLabels, h: &Hold) -> Series {
    Series {
        uuid: d.uuid.clone(),
        gpu: d.gpu.clone(),
        mig_profile: d.mig_profile.clone(),
        api: h.api.clone(),
        namespace: h.namespace.clone(),
        pod: h.pod.clone(),
        container: h.container.clone(),
        claim: h.claim.clone(),
        share: h.share.clone(),
    }
}

/// A value per (device, hold) as series.
fn per_hold(values: &[(DeviceLabels, Hold, f64)]) -> Vec<(Series, f64)> {
    values.iter().map(|(d, h, v)| (series(d, h), *v)).collect()
}

/// One scrape's telemetry.
#[derive(Debug)]
pub struct TelemetryGauges {
    pub attributed: Attributed,
    /// How long each hold has been idle, in seconds (empty while idleness is not followed).
    pub idle: Vec<(DeviceLabels, Hold, f64)>,
    /// Each hold's busy seconds so far.
    pub busy: Vec<(DeviceLabels, Hold, f64)>,
}

/// A per-device gauge: its name, help, and how to read it (`None`: not offered, no series).
type Reading = (&'static str, &'static str, fn(&Readings) -> Option<f64>);

fn ratio(p: Option<u32>) -> Option<f64> {
    p.map(|p| f64::from(p) / 100.0)
}

fn watts(mw: Option<u32>) -> Option<f64> {
    mw.map(|mw| f64::from(mw) / 1000.0)
}

// u64 counts and bytes far below 2^53 convert exactly.
#[allow(clippy::cast_precision_loss)]
fn float(v: Option<u64>) -> Option<f64> {
    v.map(|v| v as f64)
}

const READINGS: &[Reading] = &[
    (
        "gpuplane_device_gpu_utilization_ratio",
        "Share of the last sample period a kernel ran on the device (NVML utilization.gpu; not offered on MIG devices).",
        |r| ratio(r.gpu_util_percent),
    ),
    (
        "gpuplane_device_memory_utilization_ratio",
        "Share of the last sample period device memory was read or written.",
        |r| ratio(r.memory_util_percent),
    ),
    (
        "gpuplane_device_memory_used_bytes",
        "Device memory in use.",
        |r| float(r.memory_used_bytes),
    ),
    (
        "gpuplane_device_memory_total_bytes",
        "Device memory.",
        |r| float(r.memory_total_bytes),
    ),
    (
        "gpuplane_device_temperature_celsius",
        "GPU temperature.",
        |r| r.temperature_celsius.map(f64::from),
    ),
    (
        "gpuplane_device_power_watts",
        "Power draw.",
        |r| watts(r.power_milliwatts),
    ),
    (
        "gpuplane_device_power_limit_watts",
        "Enforced power limit.",
        |r| watts(r.power_limit_milliwatts),
    ),
    (
        "gpuplane_device_throttle_reasons",
        "Clock throttle reasons now, NVML's nvmlClocksThrottleReasons bitmask (1: idle, 4: software power cap, 32: software thermal slowdown, 64: hardware thermal, 128: hardware power brake).",
        |r| float(r.throttle_reasons),
    ),
    (
        "gpuplane_device_ecc_corrected_errors",
        "Corrected (single-bit) ECC errors since the driver loaded.",
        |r| float(r.ecc_corrected),
    ),
    (
        "gpuplane_device_ecc_uncorrected_errors",
        "Uncorrected (double-bit) ECC errors since the driver loaded.",
        |r| float(r.ecc_uncorrected),
    ),
    (
        "gpuplane_device_retired_pages",
        "Memory pages retired for double-bit ECC errors.",
        |r| float(r.retired_pages),
    ),
    (
        "gpuplane_device_pcie_replays",
        "PCIe replays since the driver loaded.",
        |r| float(r.pcie_replays),
    ),
];

impl Collector for TelemetryGauges {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let a = &self.attributed;
        let up: Vec<(Series, i64)> = a
            .devices
            .iter()
            .map(|d| {
                let answered = matches!(d.sample, Sample::Answered(_));
                (series(&d.device, &d.holder), i64::from(answered))
            })
            .collect();
        metrics::gauges(
            &mut e,
            "gpuplane_device_up",
            "1 if the device answered its last telemetry queries, 0 if a query failed or has not returned within an interval (the agent's log says why).",
            &up,
        )?;
        for (name, help, read) in READINGS {
            let values: Vec<(Series, f64)> = a
                .devices
                .iter()
                .filter_map(|d| match &d.sample {
                    Sample::Answered(r) => Some((series(&d.device, &d.holder), read(r)?)),
                    Sample::Failed(_) => None,
                })
                .collect();
            metrics::gauges(&mut e, name, help, &values)?;
        }
        let holders: Vec<(Series, i64)> =
            a.holders.iter().map(|(d, h)| (series(d, h), 1)).collect();
        metrics::gauges(
            &mut e,
            "gpuplane_device_holder_info",
            "1 for each holder of each device, across both kubelet APIs and every share.",
            &holders,
        )?;
        let memory: Vec<(Series, f64)> = a
            .usage
            .iter()
            .filter_map(|u| Some((series(&u.device, &u.holder), float(Some(u.memory_bytes))?)))
            .collect();
        metrics::gauges(
            &mut e,
            "gpuplane_container_gpu_memory_used_bytes",
            "Device memory a container's processes use, from NVML's process list (an MPS client's own memory, not its server's).",
            &memory,
        )?;
        let busy: Vec<(Series, f64)> = a
            .usage
            .iter()
            .filter_map(|u| Some((series(&u.device, &u.holder), ratio(u.sm_util_percent)?)))
            .collect();
        metrics::gauges(
            &mut e,
            "gpuplane_container_gpu_utilization_ratio",
            "Share of the device's SMs a container's processes kept busy (NVML per-process samples, where the device offers them).",
            &busy,
        )?;
        metrics::counters(
            &mut e,
            "gpuplane_container_gpu_busy_seconds",
            "Utilization-weighted seconds a hold's device was busy, in whole-GPU seconds (device utilization for a whole-device holder, its own processes' SM share for a share); restarts from 0 with the agent; `gpuplane controller --prometheus-url` books it as busy GPU-hours.",
            &per_hold(&self.busy),
        )?;
        metrics::gauges(
            &mut e,
            "gpuplane_held_device_idle_seconds",
            "How long a hold's device has stayed under the idle threshold (0 while busy); only with --idle-after.",
            &per_hold(&self.idle),
        )
    }
}
