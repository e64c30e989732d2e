//! A fake CUDA process, for tests: what a share container's CUDA program does with MPS, with no
//! GPU behind it. It connects to the MPS control daemon of `CUDA_MPS_PIPE_DIRECTORY` (default
//! `/tmp/nvidia-mps`) as a client of its own user id, passing its
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` and the inode of
//! its cgroup v2 directory ([`fake_mps::own_cgroup_dir`]; `-` if it cannot tell), by which the
//! daemon finds the driver's memory limit on that cgroup, as the driver knows a process's
//! cgroup without being told; checks that its
//! `/dev/shm` ([`fake_mps::SHM_ENV`]) holds the server's segment; prints the limits it was given,
//! one line:
//!
//! `connected server-uid=<n> active-thread-percentage=<p> pinned-mem-limit=<n>M|unlimited shm=<segment>`
//!
//! and holds its connection until its stdin ends (exit 0). A client of another user than the
//! running server's waits, without printing, until the daemon serves it.
//!
//! Where no daemon answers, CUDA runs without MPS ("Architecture": the client "continues to run
//! as it normally would"): it prints `no-mps active-thread-percentage=100.0
//! pinned-mem-limit=unlimited`, the whole GPU, and holds likewise. It fails (exit 1, the reason
//! on stderr) without the server's segment in its `/dev/shm`, and when its server goes away
//! while it holds the connection.

#![forbid(unsafe_code)]
#![deny(clippy::unwrap_used, clippy::expect_used)]

use fake_mps::Dirs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::sync::mpsc;

/// What ends the hold first.
enum End {
    /// Stdin closed: the program is done.
    Done,
    /// The daemon closed the connection: the server is gone.
    ServerGone,
}

fn env(name: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "-".into())
}

fn run() -> Result<(), String> {
    // The owner of /proc/self is this process's effective user: no libc call needed.
    let uid = std::fs::metadata("/proc/self")
        .map_err(|e| format!("cannot read my own user id from /proc/self: {e}"))?
        .uid();
    let dirs = Dirs::from_env();
    let Ok(mut stream) = UnixStream::connect(dirs.socket()) else {
        println!("no-mps active-thread-percentage=100.0 pinned-mem-limit=unlimited");
        return hold(None);
    };
    let cgroup = fake_mps::own_cgroup_dir()
        .and_then(|d| std::fs::metadata(d).ok())
        .map_or_else(|| "-".to_string(), |m| m.ino().to_string());
    let hello = format!(
        "{} uid={uid} threads={} pinned={} cgroup-inode={cgroup}\n",
        fake_mps::CLIENT_HELLO,
        env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    );
    stream
        .write_all(hello.as_bytes())
        .map_err(|e| format!("cannot reach the MPS control daemon: {e}"))?;
    let mut reader = BufReader::new(
        stream
            .try_clone()
            .map_err(|e| format!("cannot read from the MPS control daemon: {e}"))?,
    );
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .map_err(|e| format!("lost the MPS control daemon while connecting: {e}"))?;
    if line.is_empty() {
        return Err("the MPS control daemon closed the connection while connecting".into());
    }
    let segment = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("shm="))
        .ok_or_else(|| format!("the MPS control daemon answered {line:?}"))?;
    let shm = fake_mps::shm_dir();
    if !shm.join(segment).exists() {
        return Err(format!(
            "cannot open the MPS server's shared memory segment {segment} in {}: an MPS client \
             needs the daemon's /dev/shm",
            shm.display()
        ));
    }
    print!("{line}");
    std::io::stdout()
        .flush()
        .map_err(|e| format!("cannot write to stdout: {e}"))?;
    hold(Some(reader.into_inner()))
}

/// Waits for stdin to end, or for the server to go away first.
fn hold(server: Option<UnixStream>) -> Result<(), String> {
    let (tx, rx) = mpsc::channel();
    if let Some(mut server) = server {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut sink = [0u8; 64];
            while matches!(server.read(&mut sink), Ok(n) if n > 0) {}
            let _ = tx.send(End::ServerGone);
        });
    }
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = tx.send(End::Done);
    });
    match rx.recv() {
        Ok(End::Done) | Err(_) => Ok(()),
        Ok(End::ServerGone) => Err("the MPS server is gone: its daemon exited".into()),
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            let _ = writeln!(std::io::stderr(), "fake-cuda-client: {message}");
            ExitCode::FAILURE
        }
    }
}
