//! A simulated machine whose MIG instances and compute modes outlive the agent, as a real
//! driver's do: an agent upgrade or a new agent pod on a `--simulate` node finds the instances
//! its claims made, instead of a machine fresh from the profile (where the restarted agent would
//! have to drop those claims' instances as gone). Saved whole in
//! `<state dir>/simulated-machine.json` after every change, with the boot id; read at start
//! within the same boot only (a reboot gives a real machine back its profile's state too).

use crate::inventory::{DeviceUuid, MigDevice};
use crate::source::{
    ComputeMode, ComputeModeError, DeviceEvent, DeviceSource, Discovery, MigChangeError,
    MigRequest, SimMachine, SimSource, SourceError,
};
use crate::telemetry::Readings;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tracing::{info, warn};

/// The file's name in the state directory.
pub const FILE: &str = "simulated-machine.json";

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Saved {
    boot_id: Option<String>,
    machine: SimMachine,
}

/// [`SimSource`] kept in the state directory.
pub struct KeptSim {
    sim: SimSource,
    path: PathBuf,
    boot_id: Option<String>,
}

impl KeptSim {
    /// `sim` as this boot's earlier agents left it, when they saved it (blocking: start-up).
    pub fn open(sim: SimSource, state_dir: &Path, boot_id: Option<String>) -> KeptSim {
        let path = state_dir.join(FILE);
        match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Saved>(&bytes) {
                Ok(saved) if saved.boot_id == boot_id => match sim.restore(&saved.machine) {
                    Ok(()) => {
                        info!(path = %path.display(), "the simulated machine as this boot's earlier agent left it")
                    }
                    Err(e) => {
                        warn!(path = %path.display(), error = %e, "the saved simulated machine is another one; starting from the profile")
                    }
                },
                Ok(_) => {
                    info!(path = %path.display(), "the saved simulated machine is of an earlier boot; starting from the profile")
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "the saved simulated machine is unreadable; starting from the profile")
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                warn!(path = %path.display(), error = %e, "reading the saved simulated machine failed; starting from the profile")
            }
        }
        KeptSim { sim, path, boot_id }
    }

    /// Saves the machine after a change (the caller is on the blocking pool). A failure is
    /// logged: the change itself happened, and the next one saves again.
    fn save(&self) {
        let saved = Saved {
            boot_id: self.boot_id.clone(),
            machine: self.sim.machine(),
        };
        let written = serde_json::to_vec(&saved)
            .map_err(|e| e.to_string())
            .and_then(|b| {
                crate::fsutil::write_atomic(&self.path, &b, 0o600).map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            warn!(path = %self.path.display(), error = %e, "saving the simulated machine failed");
        }
    }
}

impl DeviceSource for KeptSim {
    fn discover(&self) -> Result<Discovery, SourceError> {
        self.sim.discover()
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<DeviceEvent>, SourceError> {
        self.sim.next_event(timeout)
    }

    fn responds(&self, gpu_uuid: &str) -> bool {
        self.sim.responds(gpu_uuid)
    }

    fn sample(&self, uuid: &DeviceUuid) -> Result<Readings, SourceError> {
        self.sim.sample(uuid)
    }

    fn create_mig(&self, req: &MigRequest) -> Result<MigDevice, MigChangeError> {
        let made = self.sim.create_mig(req)?;
        self.save();
        Ok(made)
    }

    fn destroy_mig(&self, gpu: &DeviceUuid, gpu_instance_id: u32) -> Result<(), MigChangeError> {
        self.sim.destroy_mig(gpu, gpu_instance_id)?;
        self.save();
        Ok(())
    }

    fn compute_mode(&self, gpu: &DeviceUuid) -> Result<ComputeMode, ComputeModeError> {
        self.sim.compute_mode(gpu)
    }

    fn set_compute_mode(
        &self,
        gpu: &DeviceUuid,
        mode: ComputeMode,
    ) -> Result<(), ComputeModeError> {
        self.sim.set_compute_mode(gpu, mode)?;
        self.save();
        Ok(())
    }
}
