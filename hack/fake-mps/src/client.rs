//! The client (no argument): stdin's commands to the daemon, its answers to stdout.

use fake_mps::Dirs;
use std::io::{BufRead, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// The real client's words when no daemon answers.
const NOT_FOUND: &str = "Cannot find MPS control daemon process";
/// How long the client waits, after `quit`, for the daemon's process to end.
const EXIT_WITHIN: Duration = Duration::from_secs(10);

pub(crate) fn run(dirs: &Dirs) -> Result<(), String> {
    // Like the real client, look for the daemon before reading any command.
    UnixStream::connect(dirs.socket()).map_err(|_| NOT_FOUND.to_string())?;
    let mut stdin = std::io::stdin().lock();
    let mut raw = Vec::new();
    loop {
        raw.clear();
        let n = stdin
            .read_until(b'\n', &mut raw)
            .map_err(|e| format!("cannot read commands from stdin: {e}"))?;
        if n == 0 {
            return Ok(());
        }
        let line = String::from_utf8_lossy(&raw);
        let line = line.trim();
        if !line.is_empty() {
            send(dirs, line)?;
        }
    }
}

/// Sends one command, prints the answer, and after `quit` waits for the daemon to be gone.
fn send(dirs: &Dirs, line: &str) -> Result<(), String> {
    // Read before `quit` removes it.
    let pid = dirs.recorded_pid();
    let mut stream = UnixStream::connect(dirs.socket()).map_err(|_| NOT_FOUND.to_string())?;
    let mut answer = Vec::new();
    stream
        .write_all(format!("{line}\n").as_bytes())
        .and_then(|()| stream.shutdown(Shutdown::Write))
        .and_then(|()| stream.read_to_end(&mut answer))
        .map_err(|e| format!("lost the MPS control daemon during '{line}': {e}"))?;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&answer)
        .and_then(|()| stdout.flush())
        .map_err(|e| format!("cannot write the answer to '{line}' to stdout: {e}"))?;
    // A refused `quit ...` is answered with an error; an accepted one with nothing.
    if line.split_whitespace().next() == Some("quit") && answer.is_empty() {
        if let Some(pid) = pid {
            wait_gone(pid)?;
        }
    }
    Ok(())
}

fn wait_gone(pid: u32) -> Result<(), String> {
    let deadline = Instant::now() + EXIT_WITHIN;
    while fake_mps::alive(pid) {
        if Instant::now() >= deadline {
            return Err(format!(
                "the MPS control daemon (pid {pid}) did not exit within {EXIT_WITHIN:?} of quit"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}
