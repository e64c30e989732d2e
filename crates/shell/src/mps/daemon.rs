//! `gpuplane mps-daemon`: what a daemon pod ([`gpuplane_model::mps_pod`]) runs. It starts one
//! unit's MPS control daemon (a child of this process, so of the pod's cgroup and nothing
//! else's), tells the agent it serves by holding a lock, and stops the daemon when the pod is
//! deleted (SIGTERM). When the daemon dies on its own the process ends with an error, so the
//! kubelet restarts the container and the log says why.
//!
//! Two locks in the unit's directory, both `flock`s (the kernel releases them when this process
//! ends, SIGKILL included, so neither is ever stale):
//! - `instance.lock`, exclusive, taken first and held throughout: one instance per unit at a
//!   time, even while an old container still stops beside a new one;
//! - `ready.lock`, exclusive, taken once the daemon serves and released before it is stopped:
//!   the agent's "this unit's daemon serves" ([`serving`]), readable across the agent's and
//!   the pod's PID namespaces.

use super::process::MpsDaemons;
use super::{DaemonDirs, MpsError, MpsHost};
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

/// Runs the daemon until `stop` resolves (then quits it) or it dies (an error).
pub async fn serve(
    opts: DaemonOptions,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    let daemons = MpsDaemons::at(&opts.state_dir, &opts.driver_files, &opts.proc_root);
    if !daemons.available() {
        return Err(DaemonError::NoProgram(daemons.program().to_path_buf()));
    }
    let dirs = daemons.dirs(&opts.unit);
    std::fs::create_dir_all(&dirs.root).map_err(|e| DaemonError::Lock {
        path: dirs.root.clone(),
        cause: e.to_string(),
    })?;
    let (d, o) = (daemons.clone(), opts.clone());
    let ready = blocking(move || {
        let instance = lock(
            &d.dirs(&o.unit).root.join(INSTANCE_LOCK),
            FlockArg::LockExclusive,
        )?;
        d.ensure(&o.unit, o.multiuser)?;
        let ready = lock(
            &d.dirs(&o.unit).root.join(READY_LOCK),
            FlockArg::LockExclusive,
        )?;
        Ok((instance, ready))
    })
    .await?;
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
    // Not serving from here on: the agent waits for this before it removes the directories.
    let (instance, ready) = ready;
    drop(ready);
    let unit = opts.unit.clone();
    blocking(move || Ok(daemons.quit(&unit)?)).await?;
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
