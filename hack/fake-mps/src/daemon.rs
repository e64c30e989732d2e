//! The control daemon: its start in the background (`-d`), its serving loop (`-f`, and the
//! re-executed child of `-d`) and the commands it answers.

use crate::Dirs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
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
pub(crate) fn start_background(dirs: &Dirs) -> Result<(), String> {
    if let Some(pid) = dirs.running_daemon() {
        return Err(already_running(pid));
    }
    prepare(dirs)?;
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find this program's executable to start the daemon: {e}"))?;
    let mut child = Command::new(&exe)
        .arg(crate::SERVE)
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
pub(crate) fn serve(dirs: &Dirs) -> Result<(), String> {
    let result = serve_until_quit(dirs);
    if let Err(e) = &result {
        // Best effort: the error is returned (and printed) either way.
        let _ = dirs.log_event(&format!("error {e}"));
    }
    result
}

fn serve_until_quit(dirs: &Dirs) -> Result<(), String> {
    if let Some(pid) = dirs.running_daemon() {
        return Err(already_running(pid));
    }
    prepare(dirs)?;
    let listener = bind(dirs)?;
    let started = announce(dirs);
    if started.is_err() {
        remove_files(dirs);
    }
    started?;
    let mut state = State::default();
    for conn in listener.incoming() {
        let Ok(stream) = conn else {
            // A connection that failed before it was accepted: the client sees it fail.
            continue;
        };
        match handle(dirs, &mut state, stream) {
            Ok(Flow::Continue) => {}
            Ok(Flow::Quit) => return Ok(()),
            Err(e) => {
                remove_files(dirs);
                return Err(e);
            }
        }
    }
    Ok(())
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
    UnixListener::bind(&path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))
}

/// Logs the start and writes the pid file, last, as it tells `-d` the daemon is ready. Written
/// aside and renamed so that no reader ever sees half of it.
fn announce(dirs: &Dirs) -> Result<(), String> {
    let pid = std::process::id();
    let devices = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into());
    dirs.log_event(&format!(
        "start pid={pid} CUDA_VISIBLE_DEVICES={devices} pipe={}",
        dirs.pipe.display()
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

#[derive(Debug, PartialEq)]
enum Flow {
    Continue,
    Quit,
}

/// One connection: one command line in, its answer out, closed. An empty line is a probe (the
/// client's, or `-d`'s, looking for a daemon) and is not logged.
fn handle(dirs: &Dirs, state: &mut State, stream: UnixStream) -> Result<Flow, String> {
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
    dirs.log_event(&format!("command {line}"))?;
    let reply = state.answer(line);
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

/// What the daemon remembers between commands.
struct State {
    default_active_thread_percentage: f64,
}

impl Default for State {
    fn default() -> State {
        State {
            default_active_thread_percentage: 100.0,
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
            // No CUDA client ever connects, so no server ever starts and none has clients.
            ["get_server_list"] | ["get_device_client_list"] | ["get_device_client_list", _] => {
                Reply::text("")
            }
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
