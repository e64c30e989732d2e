//! The fake `nvidia-cuda-mps-control` run as tests run it: a daemon per temporary pipe directory,
//! driven through its command line.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");

/// One pipe directory and one log directory, in a temporary directory. Dropping it stops a
/// daemon still serving there, so a failing test leaves none behind.
struct Mps {
    _tmp: tempfile::TempDir,
    pipe: PathBuf,
    log: PathBuf,
}

impl Mps {
    fn new() -> Mps {
        let tmp = tempfile::tempdir().unwrap();
        // The log directory does not exist yet: the daemon creates it.
        let (pipe, log) = (tmp.path().join("pipe"), tmp.path().join("log/mps"));
        Mps {
            _tmp: tmp,
            pipe,
            log,
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log)
            .env("CUDA_VISIBLE_DEVICES", "1");
        cmd
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
