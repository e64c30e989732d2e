//! A fake `nvidia-cuda-mps-control` for tests: NVIDIA's MPS control program as seen from its
//! command line (NVIDIA's MPS documentation, "Appendix: Tools and Interface Reference") and
//! from its CUDA clients (the fake one is `fake-cuda-client`, src/cuda_client.rs), with no GPU
//! and no CUDA behind it. It lets tests run the code that starts, queries and stops an MPS
//! control daemon, read back what that code told it, and see what a share's program gets. The
//! facts of MPS it models are listed in src/daemon.rs. Test-only: nothing shipped runs it.
//!
//! # Environment
//!
//! * `CUDA_MPS_PIPE_DIRECTORY` (default, also when empty: `/tmp/nvidia-mps`): where the daemon
//!   keeps its pid file `nvidia-cuda-mps-control.pid` (its PID, decimal, newline) and serves
//!   commands. The real one uses named pipes there; this one a unix socket named `control`.
//! * `CUDA_MPS_LOG_DIRECTORY` (default, also when empty: `/var/log/nvidia-mps`): where the
//!   daemon appends `control.log` (below). Created if missing.
//! * `CUDA_VISIBLE_DEVICES`: the GPUs the daemon would serve; only recorded in the log.
//! * `GPUPLANE_FAKE_MPS_SHM` (default `/dev/shm`): stands for `/dev/shm`; the daemon leaves a
//!   segment `cuda.shm.fake-mps.<pid>` there that its clients must see.
//! * `GPUPLANE_FAKE_NVML_STATE` (optional): the fake NVML's state file (hack/fake-nvml); the
//!   daemon caps each client's pinned memory limit at the driver's memory limit on the client's
//!   cgroup kept there (src/daemon.rs).
//!
//! # Command line
//!
//! * `nvidia-cuda-mps-control -d`: starts the daemon in the background and exits 0 once it is
//!   ready (pid file written, socket answering; at most 5 s). Exits 1 with a message on stderr
//!   if a daemon already runs for the pipe directory ("An instance of this daemon is already
//!   running"), or if the daemon did not come up (its reason is in `control.log`).
//! * `nvidia-cuda-mps-control -f`: the same daemon in the foreground, until `quit`.
//! * `-M` with `-d` or `-f`: multi-user, one server (user 0) for the clients of every user.
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
//! * `get_server_list`: the running server's "PID" (its user id plus 100000), or nothing.
//! * `get_device_client_list [<server PID>]`: empty (not modelled).
//! * `get_default_active_thread_percentage`: `100.0` unless set (one decimal, newline).
//! * `set_default_active_thread_percentage <n>`: `0 < n <= 100`; remembered for servers started
//!   from now on, and answered as `get_...` would print it. Anything else: an answer starting
//!   `Error:`.
//! * `get_default_device_pinned_mem_limit 0`, `set_default_device_pinned_mem_limit 0 <n>M|<n>G`:
//!   device 0's default pinned memory limit (`unlimited` until set), for servers started from
//!   now on.
//! * `cuda-client uid=<n> threads=<p|-> pinned=<spec|->`: a CUDA client connecting (what
//!   `fake-cuda-client` sends); served on a connection of its own (src/daemon.rs).
//! * Anything else: an answer starting `Error: Unrecognized command`.
//!
//! # `control.log`
//!
//! One line per event, `[<unix seconds>] <event>`, appended by the daemon:
//!
//! * `start pid=<pid> CUDA_VISIBLE_DEVICES=<value, or <unset>> pipe=<pipe directory>` when it
//!   is ready;
//! * `command <line>` for each command received (`quit` included), trimmed;
//! * `client uid=<n> waiting`, `client uid=<n> connected ...` (what it was answered) and
//!   `client uid=<n> gone` for each CUDA client;
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

use fake_mps::Dirs;
use std::io::Write;
use std::process::ExitCode;

/// The hidden argument `-d` re-executes this program with: serve, with no terminal.
const SERVE: &str = "--serve";
/// Multi-user mode (Volta and later): one server, run as root, for the clients of every user.
const MULTIUSER: &str = "-M";

const USAGE: &str = "usage: nvidia-cuda-mps-control [-d | -f] [-M]
  -d  start the MPS control daemon in the background
  -f  run the MPS control daemon in the foreground
  -M  multi-user: one server for the clients of every user id
  (no argument)  send the commands read from stdin to the running daemon
";

fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let args: Vec<&str> = args.iter().map(|a| a.to_str().unwrap_or("?")).collect();
    let dirs = Dirs::from_env();
    let result = match args.as_slice() {
        [] => client::run(&dirs),
        ["-d"] => daemon::start_background(&dirs, false),
        ["-d", MULTIUSER] | [MULTIUSER, "-d"] => daemon::start_background(&dirs, true),
        ["-f"] | [SERVE] => daemon::serve(&dirs, false),
        ["-f", MULTIUSER] | [MULTIUSER, "-f"] | [SERVE, MULTIUSER] => daemon::serve(&dirs, true),
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
