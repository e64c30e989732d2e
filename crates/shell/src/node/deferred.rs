//! A device source opened on first use: the agent starts even when NVML cannot be loaded or
//! initialised yet (the driver container still installing, the kernel module not loaded), and
//! the opening is retried with the start-up discovery's backoff instead of the process exiting
//! into a crash loop that would not bring the driver any sooner.

use crate::source::{DeviceEvent, DeviceSource, Discovery, SourceError};
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
}
