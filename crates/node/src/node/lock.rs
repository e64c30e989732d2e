//! One agent per state directory: an exclusive `flock` on `<state-dir>/gpuplane.lock`, taken
//! before the agent touches any socket or checkpoint and held until it stops.
//!
//! Two agents on one state directory (a debug run beside the DaemonSet pod) would overwrite each
//! other's DRA checkpoint and fight over the kubelet's sockets. `flock` belongs to the open file,
//! so the kernel releases it when the holder exits for any reason, SIGKILL included: a lock is
//! never stale and nothing needs cleaning up after a crash. The holder writes its PID into the
//! file so that a refused agent can say who is in the way; the file itself stays (removing it
//! would let a third agent lock a new file while a second still waits on the old one).

use gpuplane_model::report::chain;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The lock file's name inside the state directory.
pub const FILE_NAME: &str = "gpuplane.lock";

/// How long a refused agent waits for the holder to write its PID: the holder writes it right
/// after taking the lock, so only a start in that instant sees the file still empty.
const PID_WAIT: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another live process holds the lock.
    #[error(
        "another gpuplane agent holds {path} ({holder}): only one agent may use a state \
         directory; stop that agent first, or give this one its own --state-dir"
    )]
    Held { path: PathBuf, holder: Holder },
    #[error(
        "creating the state directory {dir}: {}; check that --state-dir names a \
         writable directory",
        chain(.cause)
    )]
    CreateDir { dir: PathBuf, cause: std::io::Error },
    #[error(
        "opening the lock file {path}: {}; it must be a regular file (not a symlink) \
         that this agent may write",
        chain(.cause)
    )]
    Open {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("locking {path}: {}; the state directory's file system must support flock", chain(.cause))]
    Lock { path: PathBuf, cause: Errno },
    #[error("writing this agent's PID into {path}: {}", chain(.cause))]
    Write {
        path: PathBuf,
        cause: std::io::Error,
    },
}

/// Who holds the lock, as its file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    Pid(u32),
    /// The file names no PID (yet): the holder is an older agent, or it wrote nothing in time.
    Unknown,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Pid(pid) => write!(f, "PID {pid}"),
            Holder::Unknown => f.write_str("PID unknown: the lock file names none"),
        }
    }
}

/// The held lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct StateLock {
    file: Flock<File>,
    path: PathBuf,
}

impl StateLock {
    /// Takes the lock on `state_dir` (created, mode 0700, if missing) without waiting: if
    /// another process holds it, fails at once with [`LockError::Held`] naming its PID.
    pub fn acquire(state_dir: &Path) -> Result<StateLock, LockError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(state_dir)
            .map_err(|source| LockError::CreateDir {
                dir: state_dir.to_path_buf(),
                cause: source,
            })?;
        let path = state_dir.join(FILE_NAME);
        // No truncation here: until we hold the lock the file's PID is the holder's.
        // O_NOFOLLOW: a symlink planted in the state directory must not make us write elsewhere.
        let open = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&path)
        };
        let mut file = open().map_err(|source| LockError::Open {
            path: path.clone(),
            cause: source,
        })?;
        let mut locked = loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(locked) => break locked,
                Err((f, Errno::EINTR)) => file = f,
                Err((f, Errno::EWOULDBLOCK)) => {
                    let holder = read_holder(f);
                    return Err(LockError::Held { path, holder });
                }
                Err((_, source)) => {
                    return Err(LockError::Lock {
                        path,
                        cause: source,
                    })
                }
            }
        };
        let pid = std::process::id();
        write_pid(&mut locked, pid).map_err(|source| LockError::Write {
            path: path.clone(),
            cause: source,
        })?;
        tracing::info!(lock = %path.display(), pid, "holding the state directory lock");
        Ok(StateLock { file: locked, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for StateLock {
    /// Clears the PID while still holding the lock (so it never erases a successor's), then the
    /// lock is released as the file closes.
    fn drop(&mut self) {
        if let Err(e) = self.file.set_len(0) {
            tracing::debug!(lock = %self.path.display(), error = %e, "could not clear the PID in the lock file");
        }
    }
}

fn write_pid(file: &mut File, pid: u32) -> std::io::Result<()> {
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(format!("{pid}\n").as_bytes())?;
    file.flush()
}

/// The holder's PID from the lock file, waiting [`PID_WAIT`] at most for it to be written.
fn read_holder(mut file: File) -> Holder {
    let deadline = Instant::now() + PID_WAIT;
    loop {
        let mut text = String::new();
        let read = file
            .seek(SeekFrom::Start(0))
            .and_then(|_| file.read_to_string(&mut text));
        if let Ok(pid) = text.trim().parse::<u32>() {
            return Holder::Pid(pid);
        }
        if read.is_err() || Instant::now() >= deadline {
            return Holder::Unknown;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_second_lock_on_the_same_dir_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = StateLock::acquire(&state).unwrap();
        assert_eq!(first.path(), state.join(FILE_NAME));
        let text = std::fs::read_to_string(first.path()).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&state), 0o700);
        assert_eq!(mode(first.path()), 0o600);

        // flock conflicts between two open files even within one process.
        let err = StateLock::acquire(&state).unwrap_err();
        match &err {
            LockError::Held { path, holder } => {
                assert_eq!(path, &state.join(FILE_NAME));
                assert_eq!(holder, &Holder::Pid(std::process::id()));
            }
            other => panic!("expected Held, got {other:?}"),
        }
        let message = err.to_string();
        assert!(message.contains(&state.join(FILE_NAME).display().to_string()));
        assert!(message.contains(&format!("PID {}", std::process::id())));
        // The refused attempt left the holder's PID alone.
        assert_eq!(
            std::fs::read_to_string(state.join(FILE_NAME)).unwrap(),
            text
        );

        drop(first);
        assert_eq!(std::fs::read_to_string(state.join(FILE_NAME)).unwrap(), "");
        let again = StateLock::acquire(&state).unwrap();
        drop(again);
    }

    #[test]
    fn a_holder_that_wrote_no_pid_is_reported_as_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let file = File::create(&path).unwrap();
        let _held = Flock::lock(file, FlockArg::LockExclusiveNonblock).unwrap();
        let err = StateLock::acquire(dir.path()).unwrap_err();
        assert!(
            matches!(
                &err,
                LockError::Held {
                    holder: Holder::Unknown,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("PID unknown"), "{err}");
    }

    #[test]
    fn a_symlinked_lock_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "keep").unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::os::unix::fs::symlink(&target, state.join(FILE_NAME)).unwrap();
        let err = StateLock::acquire(&state).unwrap_err();
        assert!(matches!(err, LockError::Open { .. }), "{err:?}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    }
}
