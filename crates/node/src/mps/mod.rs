//! MPS control daemons: one per shared unit while at least one MPS share is prepared on it,
//! started by the first share's prepare and stopped after the last share's unprepare.
//!
//! Where a daemon runs is the [`MpsHost`]:
//! - [`pods::MpsPods`] (the DaemonSet's `--mps-daemons=pods`): each daemon in a pod of its
//!   own (`gpuplane mps-daemon`, [`daemon`]), so an agent upgrade, eviction or OOM kill never
//!   ends a share's CUDA context. Rendered by `gpuplane_model::mps_pod`.
//! - [`process::MpsDaemons`] (`--mps-daemons=agent`, an agent run as a host process): each
//!   daemon a detached process of the agent's. It lives in the agent's cgroup and sees the
//!   agent's `/dev/shm`: a service manager that stops the agent's cgroup stops the daemons.
//!
//! Both keep a daemon's files under `<state dir>/mps/<unit>/` ([`DaemonDirs`]): the pipe
//! directory the clients connect through, the log directory and, for pods, the directory that
//! is the daemon's and every client's `/dev/shm`. Those directories are the record of which
//! daemons are ours; nothing started outside gpuplane lives there. At start the agent stops
//! each daemon no prepared share needs and starts the missing ones ([`MpsHost::reconcile`]).
//! Every call blocks (process runs, file reads, API calls): callers run it on the blocking
//! pool.

pub mod compute_mode;
pub mod daemon;
pub mod pods;
pub mod process;

use crate::inventory::DeviceUuid;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The control program, relative to the driver root.
pub const PROGRAM: &str = "usr/bin/nvidia-cuda-mps-control";

#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("starting the MPS control daemon for GPU {unit} failed: {cause}; its log is {log}")]
    Start {
        unit: String,
        cause: String,
        log: String,
    },
    #[error("stopping the MPS control daemon for GPU {unit} failed: {cause}; its log is {log}")]
    Stop {
        unit: String,
        cause: String,
        log: String,
    },
}

/// A daemon's directories on the host (`gpuplane_model::mps_pod::DaemonDirs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonDirs {
    pub root: PathBuf,
    pub pipe: PathBuf,
    pub log: PathBuf,
    pub shm: PathBuf,
}

impl DaemonDirs {
    pub fn new(state_dir: &Path, unit: &str) -> DaemonDirs {
        let d = gpuplane_model::mps_pod::DaemonDirs::new(&state_dir.to_string_lossy(), unit);
        DaemonDirs {
            root: d.root.into(),
            pipe: d.pipe.into(),
            log: d.log.into(),
            shm: d.shm.into(),
        }
    }

    /// The control daemon's log, named in errors.
    pub fn control_log(&self) -> String {
        self.log.join("control.log").display().to_string()
    }
}

/// Where this node's MPS control daemons run.
pub trait MpsHost: std::fmt::Debug + Send + Sync {
    /// Whether the driver root ships the control program (else shares are time-sliced).
    fn available(&self) -> bool;
    /// `unit`'s directories.
    fn dirs(&self, unit: &str) -> DaemonDirs;
    /// Whether share containers get the daemon's `/dev/shm` ([`DaemonDirs::shm`]) as theirs.
    fn shares_shm(&self) -> bool;
    /// Starts `unit`'s daemon unless it runs, multi-user when `multiuser`, and waits until it
    /// serves; true when it was started.
    fn ensure(&self, unit: &str, multiuser: bool) -> Result<bool, MpsError>;
    /// Stops `unit`'s daemon (if it runs) and removes its directories.
    fn stop(&self, unit: &str) -> Result<(), MpsError>;
    /// Makes the daemons those of `wanted` (agent start): stops each one no share needs,
    /// starts each missing one. Failures are logged; a prepare retried by the kubelet starts
    /// a missing daemon again.
    fn reconcile(&self, wanted: &BTreeMap<DeviceUuid, bool>);
}

/// Whether `program` is an executable file.
pub(crate) fn executable(program: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(program).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
