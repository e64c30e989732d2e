//! What the fake `nvidia-cuda-mps-control` (src/main.rs) and the fake CUDA client
//! (src/cuda_client.rs) share: where a daemon keeps its files, how its clients reach it, the
//! limit syntax of NVIDIA's MPS, and where a process's cgroup is. Test-only: nothing shipped
//! runs either program.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The variable naming the directory that stands for `/dev/shm` (default `/dev/shm`): the
/// daemon leaves a segment there that every client must see, as MPS clients need the
/// server's `/dev/shm`.
pub const SHM_ENV: &str = "GPUPLANE_FAKE_MPS_SHM";

/// The first word of a CUDA client's line to the daemon (src/cuda_client.rs).
pub const CLIENT_HELLO: &str = "cuda-client";

/// The directory standing for `/dev/shm`.
pub fn shm_dir() -> PathBuf {
    std::env::var_os(SHM_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/dev/shm"), PathBuf::from)
}

/// A device memory limit as MPS writes it (`512M`, `2G`, `1024MB`, `1GB`), in MiB.
pub fn parse_mib(value: &str) -> Option<u64> {
    let v = value.trim();
    let digits = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let n: u64 = digits.parse().ok()?;
    match &v[digits.len()..] {
        "M" | "MB" => Some(n),
        "G" | "GB" => n.checked_mul(1024),
        _ => None,
    }
}

/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`'s value (`0=1G,1=512M`): the limit of device `device`.
pub fn pinned_limit_for(spec: &str, device: &str) -> Option<u64> {
    spec.split(',')
        .filter_map(|e| e.split_once('='))
        .find(|(d, _)| d.trim() == device)
        .and_then(|(_, v)| parse_mib(v))
}

/// Where cgroup v2 is mounted: `/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid host
/// (v1 controllers at /sys/fs/cgroup, systemd's layout; this project's machines).
pub fn cgroup2_root() -> PathBuf {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").is_file() {
        root.to_path_buf()
    } else {
        root.join("unified")
    }
}

/// This process's cgroup v2 directory: [`cgroup2_root`] joined with the `0::<path>` line of
/// /proc/self/cgroup. In a container with a private cgroup namespace that path is `/` and the
/// mount is the container's own cgroup, so both cases name the process's own directory.
pub fn own_cgroup_dir() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = cgroup2_root().join(path.trim().trim_start_matches('/'));
    dir.join("cgroup.controllers").is_file().then_some(dir)
}

/// Where the daemon of this environment keeps its files.
pub struct Dirs {
    pub pipe: PathBuf,
    pub log: PathBuf,
}

impl Dirs {
    pub fn from_env() -> Dirs {
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

    pub fn pid_file(&self) -> PathBuf {
        self.pipe.join("nvidia-cuda-mps-control.pid")
    }

    pub fn socket(&self) -> PathBuf {
        self.pipe.join("control")
    }

    pub fn log_file(&self) -> PathBuf {
        self.log.join("control.log")
    }

    /// The PID in the pid file, if there is one that parses.
    pub fn recorded_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.pid_file()).ok()?;
        text.trim().parse().ok()
    }

    /// The PID of the daemon serving this pipe directory: the pid file's process is alive and
    /// the socket accepts a connection (either alone may be a leftover of a killed daemon).
    pub fn running_daemon(&self) -> Option<u32> {
        let pid = self.recorded_pid().filter(|&p| alive(p))?;
        UnixStream::connect(self.socket()).ok().map(|_| pid)
    }

    /// Appends `[<unix seconds>] <event>` to `control.log`, in one write so that concurrent
    /// appenders never interleave within a line.
    pub fn log_event(&self, event: &str) -> Result<(), String> {
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
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state ...`; comm may hold spaces and parentheses, so split at the last ')'.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state != "Z" && state != "X")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_read_as_mps_writes_them() {
        assert_eq!(parse_mib("512M"), Some(512));
        assert_eq!(parse_mib("2G"), Some(2048));
        assert_eq!(parse_mib("20480MB"), Some(20480));
        assert_eq!(parse_mib("1GB"), Some(1024));
        assert_eq!(parse_mib("1T"), None);
        assert_eq!(parse_mib("M"), None);
        assert_eq!(pinned_limit_for("0=1G,1=512M", "1"), Some(512));
        assert_eq!(pinned_limit_for("0=1G", "1"), None);
    }
}
