//! `gpuplane mps-daemon`: what a daemon pod ([`gpuplane_model::mps_pod`]) runs. It puts its GPU
//! in `EXCLUSIVE_PROCESS` ([`super::compute_mode`]), starts one unit's MPS control daemon (a
//! child of this process, so of the pod's cgroup and nothing else's), tells the agent it serves
//! by holding a lock, and when the pod is deleted (SIGTERM) stops the daemon and puts the
//! compute mode back. When the daemon dies on its own the process ends with an error, so the
//! kubelet restarts the container and the log says why.
//!
//! Two locks in the unit's directory, both `flock`s (the kernel releases them when this process
//! ends, SIGKILL included, so neither is ever stale):
//! - `instance.lock`, exclusive, taken first and held throughout: one instance per unit at a
//!   time, even while an old container still stops beside a new one;
//! - `ready.lock`, exclusive, taken once the daemon serves and released before it is stopped:
//!   the agent's "this unit's daemon serves" ([`serving`]), readable across the agent's and
//!   the pod's PID namespaces.

use super::compute_mode::{self, ModeError};
use super::process::MpsDaemons;
use super::{DaemonDirs, MpsError, MpsHost};
use crate::inventory::DeviceUuid;
use crate::source::DeviceSource;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tracing::info;

/// The lock one instance holds for its life.
const INSTANCE_LOCK: &str = "instance.lock";
/// The lock held while the daemon serves.
const READY_LOCK: &str = "ready.lock";
/// How often the daemon's process is checked for life.
const WATCH_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("locking {path}: {cause}; check that --state-dir is the agent's state directory and writable")]
    Lock { path: PathBuf, cause: String },
    #[error(transparent)]
    Mps(#[from] MpsError),
    #[error("the compute mode: {0}")]
    ComputeMode(#[from] ModeError),
    #[error("opening NVML ({lib}): {cause}")]
    Nvml { lib: PathBuf, cause: String },
    #[error("the MPS control daemon for GPU {unit} exited on its own; its log is {log}")]
    Died { unit: String, log: String },
    #[error("no MPS control program at {0}: is --driver-root-mount the agent's driver root?")]
    NoProgram(PathBuf),
    #[error("the daemon's job did not finish: {0}")]
    Worker(String),
}

/// One daemon pod's settings (its arguments).
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    pub unit: String,
    pub state_dir: PathBuf,
    /// Where the driver's files are mounted in this container.
    pub driver_files: PathBuf,
    pub proc_root: PathBuf,
    pub multiuser: bool,
    /// The driver's libnvidia-ml: the GPU's compute mode is set through it. `None`: left alone
    /// (simulated devices).
    pub nvml_lib: Option<PathBuf>,
}

fn lock(path: &Path, arg: FlockArg) -> Result<Flock<File>, DaemonError> {
    let fail = |cause: String| DaemonError::Lock {
        path: path.to_path_buf(),
        cause,
    };
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| fail(e.to_string()))?;
    Flock::lock(file, arg).map_err(|(_, e)| fail(e.to_string()))
}

/// Whether `dirs`' daemon serves: some process holds its `ready.lock`.
pub fn serving(dirs: &DaemonDirs) -> bool {
    held(&dirs.root.join(READY_LOCK))
}

/// Whether an instance for `dirs` still runs (serving, starting or stopping its daemon).
pub fn instance_runs(dirs: &DaemonDirs) -> bool {
    held(&dirs.root.join(INSTANCE_LOCK))
}

/// Whether some process holds `path`'s lock. Probing takes a shared lock for an instant; an
/// instance taking it exclusively at that instant waits the instant out.
fn held(path: &Path) -> bool {
    let Ok(file) = File::open(path) else {
        return false;
    };
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        Ok(_probe) => false,
        Err((_, e)) => e == Errno::EWOULDBLOCK,
    }
}

/// What a serving instance holds: its two locks and the NVML its compute mode went through.
struct Serving {
    instance: Flock<File>,
    ready: Flock<File>,
    nvml: Option<Box<dyn DeviceSource>>,
}

/// The NVML the compute mode is set through, when the unit is a GPU and a library was named.
fn open_nvml(opts: &DaemonOptions) -> Result<Option<Box<dyn DeviceSource>>, DaemonError> {
    let lib = match &opts.nvml_lib {
        Some(lib) if compute_mode::applies_to(&opts.unit) => lib,
        _ => {
            info!(unit = %opts.unit, "compute mode left alone (a MIG device, or no --nvml-lib)");
            return Ok(None);
        }
    };
    let fail = |cause: String| DaemonError::Nvml {
        lib: lib.clone(),
        cause,
    };
    let nvml = crate::nvml::NvmlSource::open(Some(lib)).map_err(|e| fail(e.to_string()))?;
    Ok(Some(Box::new(nvml)))
}

/// One instance at a time: the instance lock, the compute mode, the daemon, then the ready
/// lock (blocking).
fn start(daemons: &MpsDaemons, opts: &DaemonOptions) -> Result<Serving, DaemonError> {
    let root = daemons.dirs(&opts.unit).root;
    std::fs::create_dir_all(&root).map_err(|e| DaemonError::Lock {
        path: root.clone(),
        cause: e.to_string(),
    })?;
    let instance = lock(&root.join(INSTANCE_LOCK), FlockArg::LockExclusive)?;
    let nvml = open_nvml(opts)?;
    if let Some(nvml) = &nvml {
        let gpu = DeviceUuid::parse(opts.unit.clone()).map_err(|e| DaemonError::Nvml {
            lib: opts.nvml_lib.clone().unwrap_or_default(),
            cause: format!("--unit: {e}"),
        })?;
        compute_mode::make_exclusive(nvml.as_ref(), &gpu, &root)?;
    }
    daemons.ensure(&opts.unit, opts.multiuser)?;
    let ready = lock(&root.join(READY_LOCK), FlockArg::LockExclusive)?;
    Ok(Serving {
        instance,
        ready,
        nvml,
    })
}

/// Runs the daemon until `stop` resolves (then quits it and puts the compute mode back) or it
/// dies (an error; the compute mode stays for the restarted instance).
pub async fn serve(
    opts: DaemonOptions,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    let daemons = MpsDaemons::at(&opts.state_dir, &opts.driver_files, &opts.proc_root);
    if !daemons.available() {
        return Err(DaemonError::NoProgram(daemons.program().to_path_buf()));
    }
    let dirs = daemons.dirs(&opts.unit);
    let (d, o) = (daemons.clone(), opts.clone());
    let serving = blocking(move || start(&d, &o)).await?;
    info!(unit = %opts.unit, pipe = %dirs.pipe.display(), multiuser = opts.multiuser,
        "the MPS control daemon serves");
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => break,
            () = tokio::time::sleep(WATCH_EVERY) => {
                if !daemons.running(&opts.unit) {
                    return Err(DaemonError::Died { unit: opts.unit, log: dirs.control_log() });
                }
            }
        }
    }
    // Not serving from here on: the agent waits for the instance lock before it removes the
    // directories.
    let Serving {
        instance,
        ready,
        nvml,
    } = serving;
    drop(ready);
    let unit = opts.unit.clone();
    blocking(move || {
        daemons.quit(&unit)?;
        if let Some(nvml) = nvml {
            compute_mode::restore(nvml.as_ref(), &daemons.dirs(&unit).root)?;
        }
        Ok(())
    })
    .await?;
    drop(instance);
    info!(unit = %opts.unit, "stopped the MPS control daemon");
    Ok(())
}

async fn blocking<T: Send + 'static>(
    job: impl FnOnce() -> Result<T, DaemonError> + Send + 'static,
) -> Result<T, DaemonError> {
    tokio::task::spawn_blocking(job)
        .await
        .map_err(|e| DaemonError::Worker(e.to_string()))?
}
