//! The control daemon: its start in the background (`-d`), its serving loop (`-f`, and the
//! re-executed child of `-d`), the commands it answers and the CUDA clients it serves.
//!
//! What it models of NVIDIA's MPS (docs.nvidia.com/deploy/mps: "Architecture", "Tools and
//! Interface Reference", "Environment Variables"), because the agent's design rests on it:
//! - one MPS server at a time, for one user id: a client of another user waits until the
//!   running server's clients have all gone (then the server makes way), unless the daemon runs
//!   multi-user (`-M`: one server, as root, for every user);
//! - a server takes the daemon's default limits when it starts (`set_default_*` changes only
//!   servers started later), and a client's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and
//!   `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` "only further constrain" its server's: a client asking
//!   for more gets the server's;
//! - from driver r615 a cgroup's GPU memory limit, set through NVML, fails any allocation past
//!   its hard limit by a process in that cgroup or below it, whatever the process's `CUDA_MPS_*`
//!   environment says (NVML r615 change log; MPS documentation, "MPS v3 memory partitioning",
//!   docs.nvidia.com/deploy/mps/mpsv3-memory-partitioning.html): a client's pinned memory limit
//!   is also capped at its cgroup's hard limit (MiB, rounded down) in the fake NVML's state file
//!   that `GPUPLANE_FAKE_NVML_STATE` names in the daemon's environment, if any
//!   (`nvidia_ml::cgroup_memory_limit`);
//! - clients need the daemon's `/dev/shm` (a segment the daemon leaves in [`fake_mps::shm_dir`]);
//! - the servers live in the daemon's process: when it dies (its container or cgroup killed),
//!   every client's connection ends with it.

use fake_mps::Dirs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long `-d` waits for the daemon it started to be ready.
const READY_WITHIN: Duration = Duration::from_secs(5);
/// How long the daemon waits for a connected client's command line, so one silent client
/// cannot hold the (single-threaded) daemon for ever.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest command line read; the real commands are far shorter.
const MAX_LINE: u64 = 4096;

fn already_running(pid: u32) -> String {
    format!("An instance of this daemon is already running (pid {pid})")
}

/// Creates both directories, so that `-d` reports a bad one itself rather than through a child
/// whose stderr is closed.
fn prepare(dirs: &Dirs) -> Result<(), String> {
    for dir in [&dirs.pipe, &dirs.log] {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create directory {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// `-d`: re-executes this program with the hidden `--serve` argument, detached (no terminal,
/// its own process group, so a shell's job control or a Ctrl-C aimed at the caller leaves it
/// be), and returns once it is ready. Without `unsafe` there is no fork, hence the re-exec.
pub(crate) fn start_background(dirs: &Dirs, multiuser: bool) -> Result<(), String> {
    if let Some(pid) = dirs.running_daemon() {
        return Err(already_running(pid));
    }
    prepare(dirs)?;
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find this program's executable to start the daemon: {e}"))?;
    let mut child = Command::new(&exe)
        .arg(crate::SERVE)
        .args(multiuser.then_some(crate::MULTIUSER))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start the daemon ({}): {e}", exe.display()))?;
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(format!(
                    "the MPS control daemon exited ({status}) before it was ready; {} says why",
                    dirs.log_file().display()
                ))
            }
            Ok(None) => {}
            Err(e) => return Err(format!("cannot check on the daemon just started: {e}")),
        }
        // The pid file is written last, so with our child's PID in it the socket is bound.
        if dirs.recorded_pid() == Some(child.id()) && UnixStream::connect(dirs.socket()).is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            // Best effort: a daemon that is not ready in time is not left half-started.
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the MPS control daemon was not ready within {READY_WITHIN:?}; stopped it"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `-f` and `--serve`: serves the pipe directory until `quit`. A fatal error is also logged,
/// as the background daemon has no stderr.
pub(crate) fn serve(dirs: &Dirs, multiuser: bool) -> Result<(), String> {
    let result = serve_until_quit(dirs, multiuser);
    if let Err(e) = &result {
        // Best effort: the error is returned (and printed) either way.
        let _ = dirs.log_event(&format!("error {e}"));
    }
    result
}

fn serve_until_quit(dirs: &Dirs, multiuser: bool) -> Result<(), String> {
    if let Some(pid) = dirs.running_daemon() {
        return Err(already_running(pid));
    }
    prepare(dirs)?;
    let listener = bind(dirs)?;
    let shm = shm_segment()?;
    let started = announce(dirs, multiuser);
    if started.is_err() {
        remove_files(dirs);
    }
    started?;
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            multiuser,
            ..State::default()
        }),
        changed: Condvar::new(),
        shm: shm.clone(),
    });
    for conn in listener.incoming() {
        let Ok(stream) = conn else {
            // A connection that failed before it was accepted: the client sees it fail.
            continue;
        };
        match handle(dirs, &shared, stream) {
            Ok(Flow::Continue) => {}
            Ok(Flow::Quit) => {
                let _ = std::fs::remove_file(fake_mps::shm_dir().join(&shm));
                return Ok(());
            }
            Err(e) => {
                remove_files(dirs);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Leaves the segment clients must find in their `/dev/shm`; its name.
fn shm_segment() -> Result<String, String> {
    let name = format!("cuda.shm.fake-mps.{}", std::process::id());
    let path = fake_mps::shm_dir().join(&name);
    std::fs::write(&path, b"")
        .and_then(|()| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)))
        .map_err(|e| {
            format!(
                "cannot create the shared memory segment {}: {e}",
                path.display()
            )
        })?;
    Ok(name)
}

/// Binds the control socket. A socket file is only there after the caller found no daemon
/// answering, so it is a killed daemon's leftover: removed.
fn bind(dirs: &Dirs) -> Result<UnixListener, String> {
    let path = dirs.socket();
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(format!(
                "cannot remove stale socket {}: {e}",
                path.display()
            ))
        }
    }
    let listener = UnixListener::bind(&path)
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    // Clients of every user connect, as to the real daemon's socket.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
        .map_err(|e| format!("cannot open {} to every user: {e}", path.display()))?;
    Ok(listener)
}

/// Logs the start and writes the pid file, last, as it tells `-d` the daemon is ready. Written
/// aside and renamed so that no reader ever sees half of it.
fn announce(dirs: &Dirs, multiuser: bool) -> Result<(), String> {
    let pid = std::process::id();
    let devices = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into());
    dirs.log_event(&format!(
        "start pid={pid} CUDA_VISIBLE_DEVICES={devices} pipe={}{}",
        dirs.pipe.display(),
        if multiuser { " multiuser" } else { "" }
    ))?;
    let path = dirs.pid_file();
    let tmp = path.with_extension("pid.tmp");
    std::fs::write(&tmp, format!("{pid}\n"))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("cannot write pid file {}: {e}", path.display()))
}

/// Removes the pid file and the socket; best effort, as the daemon is leaving either way.
fn remove_files(dirs: &Dirs) {
    let _ = std::fs::remove_file(dirs.pid_file());
    let _ = std::fs::remove_file(dirs.socket());
}

/// What the connection threads share.
struct Shared {
    state: Mutex<State>,
    /// Notified whenever a client leaves (a waiting client of another user may go on).
    changed: Condvar,
    /// The segment's name in the shm directory.
    shm: String,
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, State> {
    shared.state.lock().unwrap_or_else(|p| p.into_inner())
}

/// One connection: one command line in; a command is answered and closed, a CUDA client is
/// served on a thread of its own for as long as it stays connected. An empty line is a probe
/// (the client's, or `-d`'s, looking for a daemon) and is not logged.
fn handle(dirs: &Dirs, shared: &Arc<Shared>, stream: UnixStream) -> Result<Flow, String> {
    // Best effort: without the timeouts a silent client only delays the others.
    let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
    let _ = stream.set_write_timeout(Some(CLIENT_TIMEOUT));
    let mut raw = Vec::new();
    if BufReader::new((&stream).take(MAX_LINE))
        .read_until(b'\n', &mut raw)
        .is_err()
    {
        // The client went silent or away; it has nobody to tell.
        return Ok(Flow::Continue);
    }
    let line = String::from_utf8_lossy(&raw);
    let line = line.trim();
    if line.is_empty() {
        return Ok(Flow::Continue);
    }
    if let Some(hello) = line.strip_prefix(fake_mps::CLIENT_HELLO) {
        let request = ClientRequest::parse(hello)?;
        let (dirs, shared) = (
            Dirs {
                pipe: dirs.pipe.clone(),
                log: dirs.log.clone(),
            },
            shared.clone(),
        );
        std::thread::spawn(move || serve_client(&dirs, &shared, stream, &request));
        return Ok(Flow::Continue);
    }
    dirs.log_event(&format!("command {line}"))?;
    let reply = lock(shared).answer(line);
    if reply.quit {
        remove_files(dirs);
        dirs.log_event("quit")?;
    }
    // Ignored: a client that left before its answer has nobody to tell either.
    let _ = (&stream).write_all(reply.text.as_bytes());
    Ok(if reply.quit {
        Flow::Quit
    } else {
        Flow::Continue
    })
}

/// What a CUDA client says when it connects:
/// `cuda-client uid=<n> threads=<p|-> pinned=<spec|-> cgroup-inode=<n|->` (a client without
/// the last word is one in no known cgroup).
#[derive(Debug, Clone, PartialEq)]
struct ClientRequest {
    uid: u32,
    threads: Option<f64>,
    /// Device 0's limit from the client's `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, MiB.
    pinned_mib: Option<u64>,
    /// The inode of the client's cgroup v2 directory.
    cgroup_inode: Option<u64>,
}

impl ClientRequest {
    fn parse(rest: &str) -> Result<ClientRequest, String> {
        let mut out = ClientRequest {
            uid: u32::MAX,
            threads: None,
            pinned_mib: None,
            cgroup_inode: None,
        };
        for word in rest.split_whitespace() {
            match word.split_once('=') {
                Some(("uid", v)) => out.uid = v.parse().map_err(|_| format!("bad uid {v}"))?,
                Some(("threads" | "pinned" | "cgroup-inode", "-")) => {}
                Some(("threads", v)) => out.threads = v.parse().ok(),
                Some(("pinned", v)) => out.pinned_mib = fake_mps::pinned_limit_for(v, "0"),
                Some(("cgroup-inode", v)) => {
                    out.cgroup_inode = Some(v.parse().map_err(|_| format!("bad inode {v}"))?)
                }
                _ => return Err(format!("bad client word {word}")),
            }
        }
        Ok(out)
    }
}

/// The driver's hard memory limit on the client's cgroup, MiB rounded down: what the fake
/// NVML's state file named by `GPUPLANE_FAKE_NVML_STATE` in this daemon's environment holds.
fn cgroup_limit_mib(inode: Option<u64>) -> Option<u64> {
    let state = std::env::var_os(nvidia_ml::STATE_ENV)?;
    nvidia_ml::cgroup_memory_limit(Path::new(&state), inode?).map(|bytes| bytes >> 20)
}

/// Serves one CUDA client: waits while another user's server has clients (single-user mode),
/// connects it to its user's server (started with the defaults of now, if none runs), answers
/// with the limits it gets, and keeps it until it disconnects.
fn serve_client(dirs: &Dirs, shared: &Shared, mut stream: UnixStream, req: &ClientRequest) {
    let _ = stream.set_read_timeout(None);
    let _ = dirs.log_event(&format!("client uid={} waiting", req.uid));
    // Read before waiting: the driver's limit holds from the client's start.
    let cgroup_mib = cgroup_limit_mib(req.cgroup_inode);
    let reply = {
        let mut state = lock(shared);
        while !state.may_serve(req.uid) {
            state = shared
                .changed
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
        }
        let server = state.server_for(req.uid);
        server.clients += 1;
        let threads = req
            .threads
            .map_or(server.threads, |t| t.min(server.threads));
        // The client's environment only lowers its server's; the driver's cgroup limit caps
        // both.
        let pinned = [req.pinned_mib, server.pinned_mib, cgroup_mib]
            .into_iter()
            .flatten()
            .min();
        format!(
            "connected server-uid={} active-thread-percentage={threads:.1} pinned-mem-limit={} shm={}\n",
            server.uid,
            pinned.map_or("unlimited".to_string(), |m| format!("{m}M")),
            shared.shm
        )
    };
    let _ = dirs.log_event(&format!("client uid={} {}", req.uid, reply.trim()));
    let _ = stream.write_all(reply.as_bytes());
    // Held until the client closes its end (or dies).
    let _ = std::io::copy(&mut stream, &mut std::io::sink());
    let mut state = lock(shared);
    if let Some(s) = state.server.as_mut() {
        s.clients = s.clients.saturating_sub(1);
    }
    drop(state);
    let _ = dirs.log_event(&format!("client uid={} gone", req.uid));
    shared.changed.notify_all();
}

#[derive(Debug, PartialEq)]
enum Flow {
    Continue,
    Quit,
}

/// The running MPS server.
#[derive(Debug)]
struct Server {
    /// Its user (0 in multi-user mode).
    uid: u32,
    threads: f64,
    pinned_mib: Option<u64>,
    clients: usize,
}

/// What the daemon remembers between commands.
struct State {
    multiuser: bool,
    default_active_thread_percentage: f64,
    /// Device 0's default pinned memory limit, MiB (`set_default_device_pinned_mem_limit`).
    default_pinned_mib: Option<u64>,
    server: Option<Server>,
}

impl Default for State {
    fn default() -> State {
        State {
            multiuser: false,
            default_active_thread_percentage: 100.0,
            default_pinned_mib: None,
            server: None,
        }
    }
}

#[derive(Debug, PartialEq)]
struct Reply {
    text: String,
    quit: bool,
}

impl Reply {
    fn text(text: impl Into<String>) -> Reply {
        Reply {
            text: text.into(),
            quit: false,
        }
    }
}

impl State {
    /// The server's user for a client of `uid`.
    fn server_uid(&self, uid: u32) -> u32 {
        if self.multiuser {
            0
        } else {
            uid
        }
    }

    /// Whether a client of `uid` may connect now: no server, its own user's, or an idle one.
    fn may_serve(&self, uid: u32) -> bool {
        let want = self.server_uid(uid);
        self.server
            .as_ref()
            .is_none_or(|s| s.uid == want || s.clients == 0)
    }

    /// The server a client of `uid` connects to, started (replacing an idle one of another
    /// user) with the defaults of now.
    fn server_for(&mut self, uid: u32) -> &mut Server {
        let want = self.server_uid(uid);
        let fresh = Server {
            uid: want,
            threads: self.default_active_thread_percentage,
            pinned_mib: self.default_pinned_mib,
            clients: 0,
        };
        if self.server.as_ref().is_none_or(|s| s.uid != want) {
            self.server = None;
        }
        self.server.get_or_insert(fresh)
    }

    fn answer(&mut self, line: &str) -> Reply {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["quit"] => Reply {
                text: String::new(),
                quit: true,
            },
            ["quit", "-t", secs] if secs.parse::<u32>().is_ok() => Reply {
                text: String::new(),
                quit: true,
            },
            // The fake server's "PID" is its user id plus 100000: unique per server.
            ["get_server_list"] => Reply::text(
                self.server
                    .as_ref()
                    .map(|s| format!("{}\n", 100_000 + u64::from(s.uid)))
                    .unwrap_or_default(),
            ),
            ["get_device_client_list"] | ["get_device_client_list", _] => Reply::text(""),
            ["get_default_active_thread_percentage"] => {
                Reply::text(format!("{:.1}\n", self.default_active_thread_percentage))
            }
            ["set_default_active_thread_percentage", value] => match value.parse::<f64>() {
                // NaN fails both comparisons, infinity the second.
                Ok(p) if p > 0.0 && p <= 100.0 => {
                    self.default_active_thread_percentage = p;
                    Reply::text(format!("{p:.1}\n"))
                }
                _ => Reply::text(format!(
                    "Error: invalid active thread percentage {value} (must be > 0 and <= 100)\n"
                )),
            },
            ["get_default_device_pinned_mem_limit", "0"] => Reply::text(
                self.default_pinned_mib
                    .map(|m| format!("{m}M\n"))
                    .unwrap_or_else(|| "unlimited\n".into()),
            ),
            ["set_default_device_pinned_mem_limit", "0", value] => match fake_mps::parse_mib(value)
            {
                Some(m) => {
                    self.default_pinned_mib = Some(m);
                    Reply::text("")
                }
                None => Reply::text(format!("Error: invalid memory limit {value}\n")),
            },
            _ => Reply::text(format!("Error: Unrecognized command {line}\n")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answers(lines: &[&str]) -> Vec<Reply> {
        let mut state = State::default();
        lines.iter().map(|l| state.answer(l)).collect()
    }

    #[test]
    fn the_percentage_defaults_to_100_and_is_remembered_when_valid() {
        let got = answers(&[
            "get_default_active_thread_percentage",
            "set_default_active_thread_percentage 25",
            "set_default_active_thread_percentage 0",
            "set_default_active_thread_percentage 100.5",
            "set_default_active_thread_percentage nan",
            "set_default_active_thread_percentage",
            "get_default_active_thread_percentage",
            "set_default_active_thread_percentage 100",
        ]);
        let texts: Vec<&str> = got.iter().map(|r| r.text.as_str()).collect();
        assert_eq!(texts[0], "100.0\n");
        assert_eq!(texts[1], "25.0\n");
        for t in &texts[2..5] {
            assert!(
                t.starts_with("Error: invalid active thread percentage"),
                "{t}"
            );
        }
        assert!(
            texts[5].starts_with("Error: Unrecognized command"),
            "{}",
            texts[5]
        );
        assert_eq!(texts[6], "25.0\n");
        assert_eq!(texts[7], "100.0\n");
        assert!(got.iter().all(|r| !r.quit));
    }

    #[test]
    fn a_client_request_names_its_cgroup_inode_or_none() {
        let request = |inode| ClientRequest {
            uid: 7,
            threads: None,
            pinned_mib: None,
            cgroup_inode: inode,
        };
        assert_eq!(
            ClientRequest::parse(" uid=7 threads=- pinned=- cgroup-inode=4242"),
            Ok(request(Some(4242)))
        );
        assert_eq!(
            ClientRequest::parse(" uid=7 threads=- pinned=- cgroup-inode=-"),
            Ok(request(None))
        );
        // A client of before the cgroup word: in no known cgroup.
        assert_eq!(
            ClientRequest::parse(" uid=7 threads=- pinned=-"),
            Ok(request(None))
        );
        assert!(ClientRequest::parse(" uid=7 cgroup-inode=x").is_err());
    }

    #[test]
    fn lists_are_empty_quit_quits_and_the_rest_is_refused() {
        let got = answers(&[
            "get_server_list",
            "get_device_client_list",
            "get_device_client_list 1234",
            "quit",
            "quit -t 10",
            "quit now",
            "start_server -uid 0",
        ]);
        assert_eq!(got[0], Reply::text(""));
        assert_eq!(got[1], Reply::text(""));
        assert_eq!(got[2], Reply::text(""));
        assert!(got[3].quit && got[3].text.is_empty());
        assert!(got[4].quit && got[4].text.is_empty());
        assert_eq!(
            got[5],
            Reply::text("Error: Unrecognized command quit now\n")
        );
        assert_eq!(
            got[6],
            Reply::text("Error: Unrecognized command start_server -uid 0\n")
        );
    }
}
