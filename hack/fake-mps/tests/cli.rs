//! The fake `nvidia-cuda-mps-control` run as tests run it: a daemon per temporary pipe directory,
//! driven through its command line, and the fake CUDA client (`fake-cuda-client`) connecting
//! to it as a share container's program would. The facts of MPS the stand-in models are tested
//! here, so that the agent's design is tested against them (src/daemon.rs lists them).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
const CLIENT: &str = env!("CARGO_BIN_EXE_fake-cuda-client");

/// One pipe directory and one log directory, in a temporary directory. Dropping it stops a
/// daemon still serving there, so a failing test leaves none behind.
struct Mps {
    _tmp: tempfile::TempDir,
    pipe: PathBuf,
    log: PathBuf,
    /// Stands for the host's `/dev/shm`, shared by the daemon and its clients.
    shm: PathBuf,
}

impl Mps {
    fn new() -> Mps {
        let tmp = tempfile::tempdir().unwrap();
        // Clients of other users reach the pipe directory and the segment through it.
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        // The log directory does not exist yet: the daemon creates it.
        let (pipe, log) = (tmp.path().join("pipe"), tmp.path().join("log/mps"));
        // Clients of other users cannot run the build's copy when the checkout sits in a
        // private (0700) directory, as a fresh `mktemp -d` clone does: they run this one.
        std::fs::copy(CLIENT, tmp.path().join("fake-cuda-client")).unwrap();
        let shm = tmp.path().join("shm");
        std::fs::create_dir(&shm).unwrap();
        std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o777)).unwrap();
        Mps {
            _tmp: tmp,
            pipe,
            log,
            shm,
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log)
            .env("CUDA_VISIBLE_DEVICES", "1")
            .env(fake_mps::SHM_ENV, &self.shm)
            .env_remove(nvidia_ml::STATE_ENV);
        cmd
    }

    /// A CUDA client of this daemon as user `uid` (`None`: this process's) with `env`, its
    /// stdin held open until [`Client::finish`].
    fn cuda_client(&self, uid: Option<u32>, env: &[(&str, &str)]) -> Client {
        let mut cmd = Command::new(self.pipe.with_file_name("fake-cuda-client"));
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env(fake_mps::SHM_ENV, &self.shm)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        Client::start(cmd.spawn().unwrap())
    }

    /// Runs the program with `args` and `stdin`, and waits for it.
    fn run(&self, args: &[&str], stdin: &str) -> Output {
        let mut child = self
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Ignored: a client that finds no daemon exits without reading its stdin.
        let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
        child.wait_with_output().unwrap()
    }

    fn start(&self) -> Output {
        self.run(&["-d"], "")
    }

    /// Starts the daemon (`-d`) with the fake NVML's state file `state` in its environment.
    fn start_with_state(&self, state: &Path) -> Output {
        self.command(&["-d"])
            .env(nvidia_ml::STATE_ENV, state)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn client(&self, commands: &str) -> Output {
        self.run(&[], commands)
    }

    fn pid_file(&self) -> PathBuf {
        self.pipe.join("nvidia-cuda-mps-control.pid")
    }

    fn socket(&self) -> PathBuf {
        self.pipe.join("control")
    }

    fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.pid_file())
            .ok()
            .and_then(|t| t.trim().parse().ok())
    }

    fn log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(self.log.join("control.log"))
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }

    /// The log's events, without their `[<unix seconds>] ` stamps (checked here).
    fn events(&self) -> Vec<String> {
        self.log_lines()
            .iter()
            .map(|l| {
                let (stamp, event) = l.split_once("] ").unwrap();
                let secs = stamp.strip_prefix('[').unwrap();
                assert!(secs.parse::<u64>().unwrap() > 1_600_000_000, "{l}");
                event.to_string()
            })
            .collect()
    }
}

impl Drop for Mps {
    fn drop(&mut self) {
        let _ = self.client("quit\n");
        // Never this test process: a stale-pid test writes its PID there.
        if let Some(pid) = self.pid().filter(|&p| alive(p) && p != std::process::id()) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

/// A running fake CUDA client: its first line of output arrives on a channel.
struct Client {
    child: Child,
    first: mpsc::Receiver<String>,
}

impl Client {
    fn start(mut child: Child) -> Client {
        let stdout = child.stdout.take().unwrap();
        let (tx, first) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        Client { child, first }
    }

    /// Its first line (empty if it printed none); a hang guard, not a timing assertion.
    fn line(&self) -> String {
        self.first
            .recv_timeout(Duration::from_secs(10))
            .expect("the client printed nothing within 10 s")
    }

    /// Whether it has printed its first line yet.
    fn connected(&self) -> bool {
        !matches!(self.first.try_recv(), Err(mpsc::TryRecvError::Empty))
    }

    /// Closes its stdin (its program is done) and waits: its exit status and stderr.
    fn finish(mut self) -> (ExitStatus, String) {
        drop(self.child.stdin.take());
        self.end()
    }

    /// Waits for it to exit on its own: its exit status and stderr.
    fn end(mut self) -> (ExitStatus, String) {
        // Held open across the wait, which would otherwise close it first.
        let stdin = self.child.stdin.take();
        let status = self.child.wait().unwrap();
        drop(stdin);
        let mut err = String::new();
        let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
        (status, err)
    }
}

/// The value of `key=` in a client's line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// Tests that run clients as other users need root; under CI they may not skip.
fn can_switch_users() -> bool {
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    if !root {
        assert!(
            std::env::var_os("CI").is_none(),
            "running clients as other users needs root (CI is set, so this is a failure)"
        );
        eprintln!("SKIPPED: running clients as other users needs root");
    }
    root
}

/// Running and no zombie (a daemon orphaned by `-d` may not be reaped by its new parent).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s.rsplit_once(')')?.1.split_whitespace().next()?.to_string();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn d_returns_once_the_daemon_serves_and_quit_removes_it() {
    let mps = Mps::new();
    let out = mps.start();
    assert!(out.status.success(), "-d failed: {}", text(&out.stderr));
    // Ready when -d returns: pid file written, socket answering, process detached and alive.
    let pid = mps.pid().expect("pid file after -d");
    assert_eq!(
        std::fs::read_to_string(mps.pid_file()).unwrap(),
        format!("{pid}\n")
    );
    assert!(alive(pid));
    UnixStream::connect(mps.socket()).expect("socket answers after -d");

    let out = mps.client("get_server_list\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "", "no CUDA client, so no server");

    let out = mps.client("quit\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!alive(pid), "the client returns after the daemon has gone");
    assert!(!mps.pid_file().exists(), "quit removes the pid file");
    assert!(!mps.socket().exists(), "quit removes the socket");

    let out = mps.client("get_server_list\n");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("Cannot find MPS control daemon process"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(text(&out.stdout), "");
}

#[test]
fn a_second_d_is_refused_while_the_first_serves() {
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let pid = mps.pid().unwrap();

    let out = mps.start();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("An instance of this daemon is already running"),
        "{}",
        text(&out.stderr)
    );
    // The first daemon is untouched and still answers.
    assert_eq!(mps.pid(), Some(pid));
    let out = mps.client("get_default_active_thread_percentage\n");
    assert_eq!(text(&out.stdout), "100.0\n");
    let starts = mps
        .events()
        .iter()
        .filter(|e| e.starts_with("start "))
        .count();
    assert_eq!(starts, 1, "{:?}", mps.log_lines());
}

#[test]
fn the_client_relays_each_line_and_the_daemon_remembers_the_percentage() {
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let out = mps.client(
        "get_default_active_thread_percentage\n\
         set_default_active_thread_percentage 25\n\
         \n\
         get_default_active_thread_percentage\n\
         set_default_active_thread_percentage 0\n\
         get_device_client_list\n\
         no_such_command 1\n\
         get_default_active_thread_percentage\n",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "100.0\n25.0\n25.0\n\
         Error: invalid active thread percentage 0 (must be > 0 and <= 100)\n\
         Error: Unrecognized command no_such_command 1\n\
         25.0\n"
    );
    // A later client talks to the same daemon, which still remembers.
    let out = mps.client("get_default_active_thread_percentage");
    assert_eq!(text(&out.stdout), "25.0\n");
}

#[test]
fn the_log_records_start_commands_and_quit() {
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let pid = mps.pid().unwrap();
    assert!(mps
        .client("get_server_list\n  set_default_active_thread_percentage 50  \nquit\n")
        .status
        .success());
    assert_eq!(
        mps.events(),
        [
            format!(
                "start pid={pid} CUDA_VISIBLE_DEVICES=1 pipe={}",
                mps.pipe.display()
            ),
            "command get_server_list".into(),
            "command set_default_active_thread_percentage 50".into(),
            "command quit".into(),
            "quit".into(),
        ]
    );
}

#[test]
fn f_serves_in_the_foreground_until_quit() {
    let mps = Mps::new();
    let mut daemon = mps
        .command(&["-f"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("the foreground daemon's pid file", || {
        mps.pid() == Some(daemon.id())
    });
    let out = mps.client("get_default_active_thread_percentage\nquit\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "100.0\n");
    // The client waited for it to exit (a zombie of ours until reaped here).
    let status = daemon
        .try_wait()
        .unwrap()
        .expect("exited before the client returned");
    assert!(status.success());
    assert!(!mps.pid_file().exists());
}

#[test]
fn a_client_without_a_daemon_fails_before_reading_commands() {
    let mps = Mps::new();
    let out = mps.client("get_server_list\n");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "Cannot find MPS control daemon process\n"
    );
    assert!(!mps.log.exists(), "a client writes no log");
}

#[test]
fn stale_pid_files_and_sockets_do_not_count_as_a_daemon() {
    // A dead PID, and a socket file nobody listens on.
    let mps = Mps::new();
    std::fs::create_dir_all(&mps.pipe).unwrap();
    let mut gone = Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    std::fs::write(mps.pid_file(), format!("{dead}\n")).unwrap();
    drop(UnixListener::bind(mps.socket()).unwrap());
    assert!(mps.socket().exists());
    assert_eq!(mps.client("get_server_list\n").status.code(), Some(1));
    let out = mps.start();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_ne!(mps.pid(), Some(dead));
    assert!(mps.client("quit\n").status.success());

    // A live PID (this test's) with no socket: some other process now holds the number.
    let mps = Mps::new();
    std::fs::create_dir_all(&mps.pipe).unwrap();
    std::fs::write(mps.pid_file(), format!("{}\n", std::process::id())).unwrap();
    let out = mps.start();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_ne!(mps.pid(), Some(std::process::id()));
}

#[test]
fn a_killed_daemon_is_replaced_by_the_next_d() {
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let first = mps.pid().unwrap();
    let killed = Command::new("kill")
        .args(["-KILL", &first.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    wait_until("the killed daemon to be gone", || !alive(first));
    // No signal handling: it left its files behind.
    assert_eq!(mps.pid(), Some(first));
    assert!(mps.socket().exists());

    assert_eq!(mps.client("get_server_list\n").status.code(), Some(1));
    let out = mps.start();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let second = mps.pid().unwrap();
    assert_ne!(second, first);
    assert_eq!(
        text(&mps.client("get_default_active_thread_percentage\n").stdout),
        "100.0\n"
    );
    let starts: Vec<String> = mps
        .events()
        .into_iter()
        .filter(|e| e.starts_with("start "))
        .collect();
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert!(starts[1].starts_with(&format!("start pid={second} ")));
}

#[test]
fn a_client_gets_its_servers_limits_and_asking_for_more_in_its_environment_changes_nothing() {
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let set = mps.client(
        "set_default_active_thread_percentage 25\nset_default_device_pinned_mem_limit 0 2G\n",
    );
    assert!(set.status.success(), "{}", text(&set.stderr));
    // More than the server's, in the environment: the server's limits hold.
    let greedy = mps.cuda_client(
        None,
        &[
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=80G"),
        ],
    );
    let line = greedy.line();
    assert_eq!(field(&line, "active-thread-percentage"), "25.0", "{line}");
    assert_eq!(field(&line, "pinned-mem-limit"), "2048M", "{line}");
    // Less: the client's own, further constrained.
    let modest = mps.cuda_client(
        None,
        &[
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=512M"),
        ],
    );
    let line = modest.line();
    assert_eq!(field(&line, "active-thread-percentage"), "10.0", "{line}");
    assert_eq!(field(&line, "pinned-mem-limit"), "512M", "{line}");
    // A server's limits are fixed when it starts: a new default is for the next server.
    assert!(mps
        .client("set_default_active_thread_percentage 50\n")
        .status
        .success());
    let later = mps.cuda_client(None, &[]);
    assert_eq!(field(&later.line(), "active-thread-percentage"), "25.0");
    for c in [greedy, modest, later] {
        assert!(c.finish().0.success());
    }
}

#[test]
fn without_limits_at_the_daemon_a_client_takes_the_whole_gpu_whatever_its_environment_says() {
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let c = mps.cuda_client(None, &[]);
    let line = c.line();
    assert_eq!(field(&line, "active-thread-percentage"), "100.0", "{line}");
    assert_eq!(field(&line, "pinned-mem-limit"), "unlimited", "{line}");
    assert!(c.finish().0.success());
}

#[test]
fn a_client_of_a_second_user_waits_until_the_first_users_clients_are_gone() {
    if !can_switch_users() {
        return;
    }
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let first = mps.cuda_client(Some(1000), &[]);
    assert_eq!(field(&first.line(), "server-uid"), "1000");
    let second = mps.cuda_client(Some(1001), &[]);
    wait_until("the second user's request", || {
        mps.events().iter().any(|e| e == "client uid=1001 waiting")
    });
    // The first user's client still holds its server: the second cannot be served.
    assert!(
        !second.connected(),
        "a second user's client was served at once"
    );
    assert!(first.finish().0.success());
    assert_eq!(field(&second.line(), "server-uid"), "1001");
    assert!(second.finish().0.success());
}

#[test]
fn a_multi_user_daemon_serves_clients_of_every_user_at_once() {
    if !can_switch_users() {
        return;
    }
    let mps = Mps::new();
    let out = mps.run(&["-d", "-M"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let a = mps.cuda_client(Some(1000), &[]);
    let b = mps.cuda_client(Some(1001), &[]);
    assert_eq!(field(&a.line(), "server-uid"), "0");
    assert_eq!(field(&b.line(), "server-uid"), "0");
    assert!(a.finish().0.success() && b.finish().0.success());
}

#[test]
fn a_client_without_the_daemons_dev_shm_fails() {
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let own = tempfile::tempdir().unwrap();
    let own_shm = own.path().to_str().unwrap().to_string();
    let c = mps.cuda_client(None, &[(fake_mps::SHM_ENV, own_shm.as_str())]);
    let (status, err) = c.end();
    assert!(!status.success());
    assert!(err.contains("needs the daemon's /dev/shm"), "{err}");
}

#[test]
fn clients_fail_when_their_daemon_dies_and_run_without_mps_where_none_answers() {
    let mps = Mps::new();
    assert!(mps.start().status.success());
    let c = mps.cuda_client(None, &[]);
    c.line();
    let pid = mps.pid().unwrap();
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let (status, err) = c.end();
    assert!(!status.success());
    assert!(err.contains("the MPS server is gone"), "{err}");
    // The client saw its connection close, but a killed process closes its descriptors one by
    // one: until the daemon is gone, its listening socket may still take a connection (and then
    // drop it). Wait for the exit itself.
    wait_until("the killed daemon to exit", || !alive(pid));
    // No daemon at all: CUDA runs without MPS, on the whole GPU.
    let alone = mps.cuda_client(None, &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10")]);
    let line = alone.line();
    assert!(line.starts_with("no-mps "), "{line}");
    assert_eq!(field(&line, "active-thread-percentage"), "100.0");
    assert!(alone.finish().0.success());
}

const MIB: u64 = 1 << 20;

/// This test process's cgroup v2 directory, which its clients inherit, found as the fake client
/// finds its own. Without cgroup v2 the cgroup tests skip; under CI they may not.
fn own_cgroup() -> Option<PathBuf> {
    let dir = fake_mps::own_cgroup_dir();
    if dir.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no cgroup v2 directory for this process (CI is set, so this is a failure)"
        );
        eprintln!("SKIPPED: no cgroup v2 directory for this process");
    }
    dir
}

#[test]
fn the_drivers_memory_limit_on_the_clients_cgroup_caps_it_whatever_its_environment_says() {
    let Some(cgroup) = own_cgroup() else {
        return;
    };
    let mps = Mps::new();
    let state = mps.pipe.with_file_name("fake-nvml-state.json");
    // 1.5 GiB and a little: the client sees whole MiB.
    nvidia_ml::record_memory_limit(&state, "GPU-fake", &cgroup, 0, 1536 * MIB + 1000).unwrap();
    let out = mps.start_with_state(&state);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let unset = mps.cuda_client(None, &[]);
    let line = unset.line();
    assert_eq!(field(&line, "pinned-mem-limit"), "1536M", "{line}");
    let greedy = mps.cuda_client(None, &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=80G")]);
    let line = greedy.line();
    assert_eq!(field(&line, "pinned-mem-limit"), "1536M", "{line}");
    // Below the driver's limit the environment still constrains.
    let modest = mps.cuda_client(None, &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=512M")]);
    assert_eq!(field(&modest.line(), "pinned-mem-limit"), "512M");
    // Cleared (soft 0, hard max): the next client has the whole GPU again.
    let max = nvidia_ml::MEMORY_LIMIT_MAX;
    nvidia_ml::record_memory_limit(&state, "GPU-fake", &cgroup, 0, max).unwrap();
    let after = mps.cuda_client(None, &[]);
    assert_eq!(field(&after.line(), "pinned-mem-limit"), "unlimited");
    for c in [unset, greedy, modest, after] {
        assert!(c.finish().0.success());
    }
}

#[test]
fn without_a_driver_limit_on_the_clients_cgroup_the_limits_are_as_before() {
    let mps = Mps::new();
    let state = mps.pipe.with_file_name("fake-nvml-state.json");
    // A limit on another cgroup only.
    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("cgroup.controllers"), "").unwrap();
    nvidia_ml::record_memory_limit(&state, "GPU-fake", other.path(), 0, 1024 * MIB).unwrap();
    let out = mps.start_with_state(&state);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let unset = mps.cuda_client(None, &[]);
    assert_eq!(field(&unset.line(), "pinned-mem-limit"), "unlimited");
    let asking = mps.cuda_client(None, &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2G")]);
    assert_eq!(field(&asking.line(), "pinned-mem-limit"), "2048M");
    for c in [unset, asking] {
        assert!(c.finish().0.success());
    }
}
