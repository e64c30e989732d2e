//! A simulated machine whose NVML can hang: [`StallingSim`] is a [`SimSource`] that makes its
//! `responds` or `discover` block on a [`ProbeStall`] until the test releases it, as NVML does
//! for a GPU that fell off the bus. Tests use it to show that a hung driver call stalls nothing
//! else. It lives here, not beside `SimSource` in the model, because it is test machinery
//! (threads parked on condition variables) that the product never runs.

use gpuplane_model::inventory::{DeviceUuid, MigDevice};
use gpuplane_model::source::{
    ComputeMode, ComputeModeError, DeviceEvent, DeviceSource, Discovery, MigChangeError,
    MigRequest, SimSource, SourceError,
};
use gpuplane_model::telemetry::Readings;
use std::ops::Deref;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// A hold on a source's [`DeviceSource::responds`] (from [`StallingSim::stall_probes`]) or
/// `discover` (from [`StallingSim::stall_discovery`]): while it is in place every such call
/// blocks until [`ProbeStall::release`].
#[derive(Debug, Default)]
pub struct ProbeStall {
    state: Mutex<StallState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct StallState {
    entered: u64,
    released: bool,
}

impl ProbeStall {
    /// How many calls have reached the hold so far.
    pub fn entered(&self) -> u64 {
        lock(&self.state).entered
    }

    /// Waits up to `timeout` until a call is held; whether one is.
    pub fn wait_entered(&self, timeout: Duration) -> bool {
        let guard = lock(&self.state);
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, timeout, |s| s.entered == 0)
            .unwrap_or_else(|p| p.into_inner());
        guard.entered > 0
    }

    /// Whether [`ProbeStall::release`] was called: a call held until now has not returned.
    pub fn released(&self) -> bool {
        lock(&self.state).released
    }

    /// Lets every held call (and every later one) through.
    pub fn release(&self) {
        lock(&self.state).released = true;
        self.changed.notify_all();
    }

    fn hold(&self) {
        let mut guard = lock(&self.state);
        guard.entered += 1;
        self.changed.notify_all();
        while !guard.released {
            guard = self.changed.wait(guard).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A [`SimSource`] whose probes and discoveries can be made to hang. Clones share the machine
/// and the holds, so a test stalls the source of a running agent through its own clone; the
/// simulated machine's injection (`inject_xid`, `set_lost`, ...) is reached through `Deref`.
#[derive(Debug, Clone)]
pub struct StallingSim {
    sim: SimSource,
    holds: Arc<Holds>,
}

#[derive(Debug, Default)]
struct Holds {
    probes: Mutex<Option<Arc<ProbeStall>>>,
    discovery: Mutex<Option<Arc<ProbeStall>>>,
}

impl StallingSim {
    pub fn new(sim: SimSource) -> Self {
        StallingSim {
            sim,
            holds: Arc::default(),
        }
    }

    /// Makes every probe ([`DeviceSource::responds`]) block until the returned hold is released.
    pub fn stall_probes(&self) -> Arc<ProbeStall> {
        let stall = Arc::new(ProbeStall::default());
        *lock(&self.holds.probes) = Some(stall.clone());
        stall
    }

    /// Makes every later [`DeviceSource::discover`] block until the returned hold is released.
    pub fn stall_discovery(&self) -> Arc<ProbeStall> {
        let stall = Arc::new(ProbeStall::default());
        *lock(&self.holds.discovery) = Some(stall.clone());
        stall
    }

    /// Waits on `hold` if one is in place; cloned out first, so the lock is not held while
    /// blocked.
    fn wait_on(hold: &Mutex<Option<Arc<ProbeStall>>>) {
        let stall = lock(hold).clone();
        if let Some(stall) = stall {
            stall.hold();
        }
    }
}

impl Deref for StallingSim {
    type Target = SimSource;

    fn deref(&self) -> &SimSource {
        &self.sim
    }
}

impl DeviceSource for StallingSim {
    fn discover(&self) -> Result<Discovery, SourceError> {
        Self::wait_on(&self.holds.discovery);
        self.sim.discover()
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<DeviceEvent>, SourceError> {
        self.sim.next_event(timeout)
    }

    fn responds(&self, gpu_uuid: &str) -> bool {
        Self::wait_on(&self.holds.probes);
        self.sim.responds(gpu_uuid)
    }

    fn sample(&self, uuid: &DeviceUuid) -> Result<Readings, SourceError> {
        self.sim.sample(uuid)
    }

    fn create_mig(&self, req: &MigRequest) -> Result<MigDevice, MigChangeError> {
        self.sim.create_mig(req)
    }

    fn destroy_mig(&self, gpu: &DeviceUuid, gpu_instance_id: u32) -> Result<(), MigChangeError> {
        self.sim.destroy_mig(gpu, gpu_instance_id)
    }

    fn compute_mode(&self, gpu: &DeviceUuid) -> Result<ComputeMode, ComputeModeError> {
        self.sim.compute_mode(gpu)
    }

    fn set_compute_mode(
        &self,
        gpu: &DeviceUuid,
        mode: ComputeMode,
    ) -> Result<(), ComputeModeError> {
        self.sim.set_compute_mode(gpu, mode)
    }
}

/// Locks a mutex, recovering the data if a panicking holder poisoned it (a test that failed
/// while holding it): the values guarded here stay consistent between statements.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stalled_probe_returns_only_once_released_and_then_answers_as_the_machine_does() {
        let inv = gpuplane_model::sim::load("dgx-h100").unwrap_or_else(|e| panic!("{e}"));
        let uuid = inv.gpus[0].uuid.clone();
        let source = StallingSim::new(SimSource::new(inv));
        let stall = source.stall_probes();
        let probing = source.clone();
        let probe = std::thread::spawn(move || probing.responds(uuid.as_str()));
        assert!(stall.wait_entered(Duration::from_secs(10)));
        assert!(!probe.is_finished());
        assert_eq!(stall.entered(), 1);
        stall.release();
        assert!(stall.released());
        assert!(probe.join().unwrap_or(false));
    }

    #[test]
    fn a_stalled_discovery_holds_until_released() {
        let inv = gpuplane_model::sim::load("dgx-h100").unwrap_or_else(|e| panic!("{e}"));
        let gpus = inv.gpus.len();
        let source = StallingSim::new(SimSource::new(inv));
        let stall = source.stall_discovery();
        let discovering = source.clone();
        let found =
            std::thread::spawn(move || discovering.discover().map(|d| d.inventory.gpus.len()));
        assert!(stall.wait_entered(Duration::from_secs(10)));
        stall.release();
        assert_eq!(found.join().ok().and_then(Result::ok), Some(gpus));
    }
}
