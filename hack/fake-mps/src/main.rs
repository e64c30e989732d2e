//! A fake `nvidia-cuda-mps-control` for tests: NVIDIA's MPS control program as seen from its
//! command line (NVIDIA's MPS documentation, "Appendix: Tools and Interface Reference"), with no
//! GPU, no CUDA and no MPS server behind it. It lets tests run the code that starts, queries and
//! stops an MPS control daemon, and read back what that code told it. Test-only: nothing shipped
//! runs it.
//!
//! # Environment
//!
//! * `CUDA_MPS_PIPE_DIRECTORY` (default, also when empty: `/tmp/nvidia-mps`): where the daemon
//!   keeps its pid file `nvidia-cuda-mps-control.pid` (its PID, decimal, newline) and serves
//!   commands. The real one uses named pipes there; this one a unix socket named `control`.
//! * `CUDA_MPS_LOG_DIRECTORY` (default, also when empty: `/var/log/nvidia-mps`): where the
//!   daemon appends `control.log` (below). Created if missing.
//! * `CUDA_VISIBLE_DEVICES`: the GPUs the daemon would serve; only recorded in the log.
//!
//! # Command line
//!
//! * `nvidia-cuda-mps-control -d`: starts the daemon in the background and exits 0 once it is
//!   ready (pid file written, socket answering; at most 5 s). Exits 1 with a message on stderr
//!   if a daemon already runs for the pipe directory ("An instance of this daemon is already
//!   running"), or if the daemon did not come up (its reason is in `control.log`).
//! * `nvidia-cuda-mps-control -f`: the same daemon in the foreground, until `quit`.
//! * `nvidia-cuda-mps-control` (no argument): the client. Reads commands from stdin, one per line
//!   (blank lines skipped), sends each to the daemon of the pipe directory and prints its answer
//!   on stdout; exits 0 at the end of stdin. If no daemon answers (at the start or at any
//!   command): "Cannot find MPS control daemon process" on stderr, exit 1. After `quit` it
//!   returns once the daemon's process has gone. Error answers are printed like any other answer
//!   and do not change the exit status.
//! * `-h`, `--help`: usage. Anything else: usage on stderr, exit 1.
//!
//! # Commands the daemon understands
//!
//! * `quit` (or `quit -t <seconds>`, the timeout ignored): removes the pid file and the socket,
//!   logs, answers nothing and exits.
//! * `get_server_list`: the PIDs of the MPS servers, one a line: none, as no CUDA client ever
//!   connects, so an empty answer.
//! * `get_device_client_list [<server PID>]`: empty, for the same reason.
//! * `get_default_active_thread_percentage`: `100.0` unless set (one decimal, newline).
//! * `set_default_active_thread_percentage <n>`: `0 < n <= 100`; remembered, and answered as
//!   `get_...` would print it. Anything else: an answer starting `Error:`.
//! * Anything else: an answer starting `Error: Unrecognized command`.
//!
//! # `control.log`
//!
//! One line per event, `[<unix seconds>] <event>`, appended by the daemon:
//!
//! * `start pid=<pid> CUDA_VISIBLE_DEVICES=<value, or <unset>> pipe=<pipe directory>` when it
//!   is ready;
//! * `command <line>` for each command received (`quit` included), trimmed;
//! * `quit` when it has removed its files and is about to exit;
//! * `error <message>` when the daemon gives up (it could not bind, write its pid file, ...).
//!
//! # What is left out
//!
//! No signal handling (that needs `unsafe` or a signal crate): a daemon killed by a signal
//! leaves its pid file and socket behind. The next start, and the client, treat a daemon as
//! running only if the pid file's process is alive (`/proc/<pid>` exists and is no zombie) and
//! the socket accepts a connection, so such leftovers are replaced. Two starts racing on one
//! pipe directory are not arbitrated.

#![forbid(unsafe_code)]
#![deny(clippy::unwrap_used, clippy::expect_used)]

mod client;
mod daemon;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

/// The hidden argument `-d` re-executes this program with: serve, with no terminal.
const SERVE: &str = "--serve";

const USAGE: &str = "usage: nvidia-cuda-mps-control [-d | -f]
  -d  start the MPS control daemon in the background
  -f  run the MPS control daemon in the foreground
  (no argument)  send the commands read from stdin to the running daemon
";

/// Where the daemon of this environment keeps its files.
pub(crate) struct Dirs {
    pub(crate) pipe: PathBuf,
    pub(crate) log: PathBuf,
}

impl Dirs {
    fn from_env() -> Dirs {
        let dir = |var: &str, default: &str| {
            std::env::var_os(var)
                .filter(|v| !v.is_empty())
                .map_or_else(|| PathBuf::from(default), PathBuf::from)
        };
        Dirs {
            pipe: dir("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
            log: dir("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"),
        }
    }

    pub(crate) fn pid_file(&self) -> PathBuf {
        self.pipe.join("nvidia-cuda-mps-control.pid")
    }

    pub(crate) fn socket(&self) -> PathBuf {
        self.pipe.join("control")
    }

    pub(crate) fn log_file(&self) -> PathBuf {
        self.log.join("control.log")
    }

    /// The PID in the pid file, if there is one that parses.
    pub(crate) fn recorded_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.pid_file()).ok()?;
        text.trim().parse().ok()
    }

    /// The PID of the daemon serving this pipe directory: the pid file's process is alive and
    /// the socket accepts a connection (either alone may be a leftover of a killed daemon).
    pub(crate) fn running_daemon(&self) -> Option<u32> {
        let pid = self.recorded_pid().filter(|&p| alive(p))?;
        UnixStream::connect(self.socket()).ok().map(|_| pid)
    }

    /// Appends `[<unix seconds>] <event>` to `control.log`, in one write so that concurrent
    /// appenders never interleave within a line.
    pub(crate) fn log_event(&self, event: &str) -> Result<(), String> {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let path = self.log_file();
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("[{secs}] {event}\n").as_bytes()))
            .map_err(|e| format!("cannot append to {}: {e}", path.display()))
    }
}

/// Whether process `pid` is running. A zombie (state Z, or X while it is being reaped) has
/// exited; its parent just has not collected it, which an orphaned daemon's new parent may
/// never do.
pub(crate) fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state ...`; comm may hold spaces and parentheses, so split at the last ')'.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state != "Z" && state != "X")
}

fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let args: Vec<&str> = args.iter().map(|a| a.to_str().unwrap_or("?")).collect();
    let dirs = Dirs::from_env();
    let result = match args.as_slice() {
        [] => client::run(&dirs),
        ["-d"] => daemon::start_background(&dirs),
        ["-f"] | [SERVE] => daemon::serve(&dirs),
        ["-h" | "--help"] => std::io::stdout()
            .write_all(USAGE.as_bytes())
            .map_err(|e| format!("nvidia-cuda-mps-control: cannot print usage: {e}")),
        _ => Err(format!(
            "nvidia-cuda-mps-control: unknown arguments {args:?}\n{USAGE}"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            // Ignored: with stderr gone there is nowhere left to say it.
            let _ = writeln!(std::io::stderr(), "{}", message.trim_end());
            ExitCode::FAILURE
        }
    }
}
