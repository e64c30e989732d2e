//! MIG devices' utilization through GPM (NVML's GPU Performance Monitoring, Hopper and later):
//! `nvmlDeviceGetUtilizationRates` answers NOT_SUPPORTED on a GPU in MIG mode and on MIG
//! devices (NVML API reference), so a MIG device's activity is NVML_GPM_METRIC_GRAPHICS_UTIL
//! between two `nvmlGpmMigSampleGet` samples of its GPU instance, taken on the parent GPU's
//! handle. Each MIG device's last sample is kept here between sampling rounds, as a raw handle
//! (a `GpmSample` borrows the `Nvml` it came from), freed when replaced and before NVML shuts
//! down. The first round of a device has no earlier sample, so no reading.

use super::call::describe;
use super::raw;
use crate::inventory::DeviceUuid;
use crate::source::SourceError;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::gpm_metrics_get;
use nvml_wrapper::{Device, Nvml};
use raw::RawGpmSample;
use std::collections::HashMap;
use std::sync::Mutex;

/// Each MIG device's last GPM sample.
#[derive(Default)]
pub(super) struct GpmSamples {
    last: Mutex<HashMap<DeviceUuid, RawGpmSample>>,
}

fn failed(call: &'static str) -> impl Fn(NvmlError) -> SourceError {
    move |e| SourceError::Query {
        call: call.into(),
        reason: describe(&e),
    }
}

impl GpmSamples {
    /// Percent of the time since MIG device `uuid`'s previous sample that its GPU instance
    /// was active; `None` on its first sample or where the GPU has no GPM.
    pub(super) fn mig_util(
        &self,
        nvml: &Nvml,
        mig: &Device<'_>,
        uuid: &DeviceUuid,
    ) -> Result<Option<u32>, SourceError> {
        let parent = mig
            .mig_parent_device()
            .map_err(failed("nvmlDeviceGetDeviceHandleFromMigDeviceHandle"))?;
        let Some(true) =
            super::telemetry::offered("nvmlGpmQueryDeviceSupport", parent.gpm_support())?
        else {
            return Ok(None);
        };
        let gi = raw::gpu_instance_id(nvml, mig).map_err(failed("nvmlDeviceGetGpuInstanceId"))?;
        let new = parent
            .gpm_mig_sample(gi)
            .map_err(failed("nvmlGpmMigSampleGet"))?;
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let util = match last.remove(uuid) {
            Some(kept) => {
                // Freed when it goes out of scope: `new` replaces it.
                let previous = raw::gpm_sample(nvml, kept);
                let metrics = gpm_metrics_get(nvml, &previous, &new, &[GpmMetricId::GraphicsUtil]);
                let first = metrics.and_then(|m| m.into_iter().next().transpose());
                super::telemetry::offered("nvmlGpmMetricsGet", first)?
                    .flatten()
                    // A percentage, 0.0 to 100.0.
                    .map(|m| m.value.round().clamp(0.0, 100.0) as u32)
            }
            None => None,
        };
        last.insert(uuid.clone(), raw::keep_gpm_sample(new));
        Ok(util)
    }

    /// Frees every kept sample; before NVML shuts down.
    pub(super) fn free(&self, nvml: &Nvml) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        for (_, kept) in last.drain() {
            drop(raw::gpm_sample(nvml, kept));
        }
    }
}
