//! MPS control daemons as processes of the calling program: NVIDIA's
//! `nvidia-cuda-mps-control -d` from the driver root, run with `CUDA_VISIBLE_DEVICES` = the
//! unit's UUID and its pipe and log directories from [`DaemonDirs`] (NVIDIA's MPS
//! documentation: the control daemon writes `nvidia-cuda-mps-control.pid` into its pipe
//! directory; `quit` sent through the same program in client mode stops it). On Volta and
//! later the daemon is multi-user (`-M`), so share pods of different users run at once; before
//! Volta a second user's client waits for the first's to end.
//!
//! The agent's `--mps-daemons=agent` host, and what `gpuplane mps-daemon` ([`super::daemon`])
//! runs inside a daemon pod.

use super::{executable, DaemonDirs, MpsError, MpsHost, PROGRAM};
use crate::inventory::DeviceUuid;
use crate::paths::HostPaths;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// The file the control daemon writes its PID into, in its pipe directory.
const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Multi-user mode: one MPS server, run as root, for the clients of every user. Without it a
/// daemon serves one user at a time and a client of a second user waits until every client of
/// the first has ended (NVIDIA's MPS documentation, "Architecture": "Provisioning Sequence",
/// "Multi-user support"; the flag as NVIDIA's DRA driver passes it,
/// templates/mps-control-daemon.tmpl.yaml). Volta and later only.
const MULTIUSER: &str = "-M";
/// How long one run of the control program may take (`-d` returns once the daemon is up).
const RUN_TIMEOUT: Duration = Duration::from_secs(10);

/// MPS control daemons run as this program's detached children.
#[derive(Debug, Clone)]
pub struct MpsDaemons {
    program: PathBuf,
    state_dir: PathBuf,
    proc_root: PathBuf,
}

impl MpsDaemons {
    pub fn new(paths: &HostPaths) -> MpsDaemons {
        MpsDaemons::at(&paths.state_dir, paths.driver_files(), &paths.proc_root)
    }

    /// Daemons of the driver mounted at `driver_files`, with their files under `state_dir`.
    pub fn at(state_dir: &Path, driver_files: &Path, proc_root: &Path) -> MpsDaemons {
        MpsDaemons {
            program: driver_files.join(PROGRAM),
            state_dir: state_dir.to_path_buf(),
            proc_root: proc_root.to_path_buf(),
        }
    }

    pub fn program(&self) -> &Path {
        &self.program
    }

    fn base(&self) -> PathBuf {
        self.state_dir.join("mps")
    }

    pub fn dirs(&self, unit: &str) -> DaemonDirs {
        DaemonDirs::new(&self.state_dir, unit)
    }

    /// Whether `unit`'s daemon runs: its PID file names a live process (a zombie, dead but
    /// not yet reaped, is not).
    pub fn running(&self, unit: &str) -> bool {
        let pid = std::fs::read_to_string(self.dirs(unit).pipe.join(PID_FILE)).ok();
        let stat = pid
            .and_then(|p| p.trim().parse::<u32>().ok())
            .and_then(|pid| {
                std::fs::read_to_string(self.proc_root.join(format!("{pid}/stat"))).ok()
            });
        // `<pid> (<comm>) <state> ...`: the state follows the last `)`.
        stat.and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().to_string())
        })
        .is_some_and(|rest| !rest.starts_with('Z') && !rest.starts_with('X'))
    }

    /// Stops `unit`'s daemon if it runs (`quit`), and waits until it has exited; its
    /// directories stay.
    pub fn quit(&self, unit: &str) -> Result<(), MpsError> {
        let dirs = self.dirs(unit);
        let fail = |cause: String| MpsError::Stop {
            unit: unit.to_string(),
            cause,
            log: dirs.control_log(),
        };
        if self.running(unit) {
            run(self.command(&dirs), Some(b"quit\n")).map_err(fail)?;
            let deadline = Instant::now() + RUN_TIMEOUT;
            while self.running(unit) {
                if Instant::now() > deadline {
                    return Err(fail("it did not exit after quit".into()));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            info!(unit, "stopped the MPS control daemon");
        }
        Ok(())
    }

    /// Units with a daemon directory (ours, running or left by a crash).
    pub fn units(&self) -> Vec<String> {
        std::fs::read_dir(self.base())
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn command(&self, dirs: &DaemonDirs) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", &dirs.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &dirs.log);
        cmd
    }
}

impl MpsHost for MpsDaemons {
    fn available(&self) -> bool {
        executable(&self.program)
    }

    fn dirs(&self, unit: &str) -> DaemonDirs {
        MpsDaemons::dirs(self, unit)
    }

    /// A detached process keeps the agent's `/dev/shm`: there is no directory to hand out.
    fn shares_shm(&self) -> bool {
        false
    }

    /// Starts `unit`'s daemon unless it runs, multi-user (`-M`) when `multiuser`; true when it
    /// was started.
    fn ensure(&self, unit: &str, multiuser: bool) -> Result<bool, MpsError> {
        if self.running(unit) {
            return Ok(false);
        }
        let dirs = self.dirs(unit);
        let fail = |cause: String| MpsError::Start {
            unit: unit.to_string(),
            cause,
            log: dirs.control_log(),
        };
        for d in [&dirs.pipe, &dirs.log] {
            std::fs::create_dir_all(d)
                .map_err(|e| fail(format!("creating {}: {e}", d.display())))?;
        }
        let mut cmd = self.command(&dirs);
        cmd.arg("-d").env("CUDA_VISIBLE_DEVICES", unit);
        if multiuser {
            cmd.arg(MULTIUSER);
        }
        run(cmd, None).map_err(fail)?;
        if !self.running(unit) {
            return Err(fail(format!(
                "{} -d returned but no daemon runs",
                self.program.display()
            )));
        }
        info!(unit, pipe = %dirs.pipe.display(), "started the MPS control daemon");
        Ok(true)
    }

    /// Stops `unit`'s daemon (if it runs) and removes its directories.
    fn stop(&self, unit: &str) -> Result<(), MpsError> {
        self.quit(unit)?;
        let dirs = self.dirs(unit);
        match std::fs::remove_dir_all(&dirs.root) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(MpsError::Stop {
                unit: unit.to_string(),
                cause: format!("removing its directories: {e}"),
                log: dirs.control_log(),
            }),
        }
    }

    /// Makes the running daemons those of `wanted` (agent start): stops each one no share
    /// needs, starts each missing one. Failures are logged; a prepare retried by the kubelet
    /// starts a missing daemon again.
    fn reconcile(&self, wanted: &BTreeMap<DeviceUuid, bool>) {
        for unit in self.units() {
            if !wanted.keys().any(|w| w.as_str() == unit) {
                info!(unit = %unit, "an MPS control daemon serves no prepared share; stopping it");
                if let Err(e) = self.stop(&unit) {
                    warn!(error = %e, "stopping an unneeded MPS control daemon failed");
                }
            }
        }
        for (unit, multiuser) in wanted {
            match self.ensure(unit, *multiuser) {
                Ok(true) => {
                    info!(unit = %unit, "a prepared share had no MPS control daemon; started one")
                }
                Ok(false) => info!(unit = %unit, "adopted the running MPS control daemon"),
                Err(e) => {
                    warn!(error = %e, "starting the MPS control daemon of prepared shares failed")
                }
            }
        }
    }
}

/// Runs the control program to completion (bounded), feeding it `stdin`; an error says how it
/// failed, with its stderr.
fn run(mut cmd: Command, stdin: Option<&[u8]>) -> Result<(), String> {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("running it: {e}"))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input)
            .map_err(|e| format!("writing its commands: {e}"))?;
    }
    let deadline = Instant::now() + RUN_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                // Best effort: it is being abandoned either way.
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {RUN_TIMEOUT:?}"));
            }
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        // What it printed is the clearest reason; a read failure leaves the status alone.
        let _ = e.read_to_string(&mut err);
    }
    Err(format!("it exited with {status}: {}", err.trim()))
}
