//! A device source opened on first use: the agent starts even when NVML cannot be loaded or
//! initialised yet (the driver container still installing, the kernel module not loaded), and
//! the opening is retried with the start-up discovery's backoff instead of the process exiting
//! into a crash loop that would not bring the driver any sooner.

use crate::inventory::{DeviceUuid, MigDevice};
use crate::source::{
    ComputeMode, ComputeModeError, DeviceEvent, DeviceSource, Discovery, MigChangeError,
    MigRequest, SourceError,
};
use crate::telemetry::Readings;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

type Open = dyn Fn() -> Result<Box<dyn DeviceSource>, SourceError> + Send + Sync;

/// Opens the wrapped source on the first `discover` that succeeds in opening it; until then
/// `discover` fails with the opening's error, no GPU responds and no event comes.
pub struct Deferred {
    open: Box<Open>,
    opened: OnceLock<Box<dyn DeviceSource>>,
    /// Serialises openings: the event pump and the inventory refresher may ask at once.
    opening: Mutex<()>,
}

impl Deferred {
    pub fn new(
        open: impl Fn() -> Result<Box<dyn DeviceSource>, SourceError> + Send + Sync + 'static,
    ) -> Deferred {
        Deferred {
            open: Box::new(open),
            opened: OnceLock::new(),
            opening: Mutex::new(()),
        }
    }

    fn get(&self) -> Result<&dyn DeviceSource, SourceError> {
        if let Some(s) = self.opened.get() {
            return Ok(s.as_ref());
        }
        // A poisoned lock guards no data; the next opening is as good as any.
        let _one = self.opening.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = self.opened.get() {
            return Ok(s.as_ref());
        }
        let source = (self.open)()?;
        Ok(self.opened.get_or_init(|| source).as_ref())
    }

    /// A MIG change on the source, opened first if need be (the agent changes MIG instances
    /// only on GPUs a discovery listed, so it is open by then); a source that does not open
    /// fails the change with the opening's error.
    fn opened_for<T>(
        &self,
        change: impl FnOnce(&dyn DeviceSource) -> Result<T, MigChangeError>,
    ) -> Result<T, MigChangeError> {
        let source = self.get().map_err(|e| MigChangeError::Failed {
            call: "nvmlInit_v2".into(),
            reason: e.to_string(),
        })?;
        change(source)
    }
}

impl DeviceSource for Deferred {
    fn discover(&self) -> Result<Discovery, SourceError> {
        self.get()?.discover()
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<DeviceEvent>, SourceError> {
        match self.opened.get() {
            Some(s) => s.next_event(timeout),
            None => {
                std::thread::sleep(timeout);
                Ok(None)
            }
        }
    }

    fn responds(&self, gpu_uuid: &str) -> bool {
        self.opened.get().is_some_and(|s| s.responds(gpu_uuid))
    }

    fn sample(&self, uuid: &DeviceUuid) -> Result<Readings, SourceError> {
        self.get()?.sample(uuid)
    }

    fn create_mig(&self, req: &MigRequest) -> Result<MigDevice, MigChangeError> {
        self.opened_for(|s| s.create_mig(req))
    }

    fn destroy_mig(&self, gpu: &DeviceUuid, gpu_instance_id: u32) -> Result<(), MigChangeError> {
        self.opened_for(|s| s.destroy_mig(gpu, gpu_instance_id))
    }

    fn compute_mode(&self, gpu: &DeviceUuid) -> Result<ComputeMode, ComputeModeError> {
        self.get().map_err(unopened)?.compute_mode(gpu)
    }

    fn set_compute_mode(
        &self,
        gpu: &DeviceUuid,
        mode: ComputeMode,
    ) -> Result<(), ComputeModeError> {
        self.get().map_err(unopened)?.set_compute_mode(gpu, mode)
    }

    fn memory_limit_library(&self) -> Option<std::path::PathBuf> {
        self.opened.get().and_then(|s| s.memory_limit_library())
    }
}

/// NVML not open yet: the call fails as `nvmlInit` did.
fn unopened(e: SourceError) -> ComputeModeError {
    ComputeModeError::Failed {
        call: "nvmlInit_v2".into(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::SimSource;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn opens_once_the_opening_succeeds_and_then_delegates() {
        let tries = Arc::new(AtomicU32::new(0));
        let sim = SimSource::new(crate::sim::load("pcie-l4x4").unwrap());
        let (t, s) = (tries.clone(), sim.clone());
        let source = Deferred::new(move || {
            if t.fetch_add(1, Ordering::SeqCst) < 2 {
                Err(SourceError::Unavailable("driver not loaded".into()))
            } else {
                Ok(Box::new(s.clone()))
            }
        });
        for _ in 0..2 {
            let e = source.discover().unwrap_err();
            assert!(e.to_string().contains("driver not loaded"), "{e}");
        }
        assert_eq!(source.next_event(Duration::ZERO).unwrap(), None);
        let found = source.discover().unwrap();
        assert_eq!(found.inventory.gpus.len(), 4);
        assert!(source.responds(&found.inventory.gpus[0].uuid));
        source.discover().unwrap();
        assert_eq!(tries.load(Ordering::SeqCst), 3, "opened once");
    }

    #[test]
    fn mig_changes_reach_the_opened_source_and_fail_while_it_does_not_open() {
        let sim = SimSource::new(crate::sim::load("dynamic-mig-mixed").unwrap());
        let gpu = sim.discover().unwrap().inventory.gpus[0].uuid.clone();
        let req = MigRequest {
            gpu: gpu.clone(),
            profile: "7g.80gb".into(),
            start: 0,
        };
        let refusing = Deferred::new(|| Err(SourceError::Unavailable("driver not loaded".into())));
        let e = refusing.create_mig(&req).unwrap_err();
        assert!(e.to_string().contains("driver not loaded"), "{e}");
        let s = sim.clone();
        let source = Deferred::new(move || Ok(Box::new(s.clone())));
        let created = source.create_mig(&req).unwrap();
        assert_eq!(
            sim.discover().unwrap().inventory.gpus[0].mig_devices,
            std::slice::from_ref(&created)
        );
        source.destroy_mig(&gpu, created.gpu_instance_id).unwrap();
        assert!(sim.discover().unwrap().inventory.gpus[0]
            .mig_devices
            .is_empty());
    }
}
