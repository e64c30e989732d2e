//! The agent's own CDI hook, as a container runtime runs it: `gpuplane cdi-hook memory-limit`
//! holds a share's container to its GPU memory by the driver's per-cgroup limit
//! ([`gpuplane_model::cdi::memory_limit`] has the why), and the install of the executable it
//! runs where the host can find it.
//!
//! The hook runs as a `createRuntime` hook: in the runtime's namespaces, as root, after the
//! runtime put the container's first process in its cgroup and before that process runs the
//! container's program. It reads the container's state on stdin, finds the process's cgroup in
//! `/proc/<pid>/cgroup` and sets the limit on that directory under the cgroup root. Any failure
//! exits non-zero, and the runtime then fails the container's creation: a share that cannot be
//! held never starts unheld.

use crate::fsutil::{self, FsError};
use gpuplane_model::cdi::memory_limit::{cgroup_v2_path, ContainerState};
use std::path::{Path, PathBuf};

/// Where the installed executable lives under the agent's state directory.
const HOOK_EXE: &str = "bin/gpuplane";

/// Why a memory-limit hook could not hold its container.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("the container state on stdin is not OCI state JSON ({0}); run this only as a CDI hook of a container runtime")]
    State(String),
    #[error("container {id}: the runtime passed no pid; the hook must run at createRuntime, after the container process exists")]
    NoPid { id: String },
    #[error("container {id}: cannot read {path}: {cause}")]
    Cgroup {
        id: String,
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("container {id}: {path} names no cgroup v2 path; per-cgroup GPU memory limits need cgroup v2 mounted at /sys/fs/cgroup")]
    NotV2 { id: String, path: PathBuf },
    #[error("container {id}: cannot hold cgroup {cgroup} to its GPU memory: {cause}")]
    Limit {
        id: String,
        cgroup: PathBuf,
        cause: crate::nvml::MemoryLimitError,
    },
}

/// Why the hook's executable could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("cannot read the agent's executable {path} to install it for CDI hooks: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("cannot create {dir} for the CDI hooks' executable: {cause}")]
    CreateDir { dir: PathBuf, cause: std::io::Error },
    #[error("cannot install the CDI hooks' executable: {0}")]
    Write(#[from] FsError),
}

/// One memory-limit hook's arguments.
#[derive(Debug, Clone)]
pub struct MemoryLimit {
    pub nvml_lib: PathBuf,
    pub gpu: String,
    pub bytes: u64,
}

/// Runs the hook: `state` is what the runtime wrote on stdin, `proc_root` the host's `/proc`
/// and `cgroup_root` where the host mounts cgroup v2 (`/sys/fs/cgroup`, where NVIDIA's memory
/// partitioning requires it). Returns the cgroup directory now limited.
pub fn apply_memory_limit(
    state: &[u8],
    proc_root: &Path,
    cgroup_root: &Path,
    limit: &MemoryLimit,
) -> Result<PathBuf, HookError> {
    let state: ContainerState =
        serde_json::from_slice(state).map_err(|e| HookError::State(e.to_string()))?;
    let id = state.id.clone();
    let pid = state
        .pid
        .ok_or_else(|| HookError::NoPid { id: id.clone() })?;
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let text = std::fs::read_to_string(&path).map_err(|cause| HookError::Cgroup {
        id: id.clone(),
        path: path.clone(),
        cause,
    })?;
    let relative = cgroup_v2_path(&text).ok_or_else(|| HookError::NotV2 {
        id: id.clone(),
        path: path.clone(),
    })?;
    let cgroup = cgroup_root.join(relative.trim_start_matches('/'));
    crate::nvml::set_cgroup_memory_limit(&limit.nvml_lib, &limit.gpu, &cgroup, limit.bytes)
        .map_err(|cause| HookError::Limit {
            id,
            cgroup: cgroup.clone(),
            cause,
        })?;
    Ok(cgroup)
}

/// Installs `exe` (the agent's own executable) as `<state_dir>/bin/gpuplane`, which the
/// memory-limit hooks of CDI specs run: the state directory is the same path on the host and
/// in the agent's container. Replaced atomically only when its content differs, so a hook
/// running during an agent upgrade keeps the file it started. Blocking: call it off the
/// async runtime.
pub fn install_hook_exe(exe: &Path, state_dir: &Path) -> Result<PathBuf, InstallError> {
    let target = state_dir.join(HOOK_EXE);
    let bytes = std::fs::read(exe).map_err(|cause| InstallError::Read {
        path: exe.to_path_buf(),
        cause,
    })?;
    if std::fs::read(&target).is_ok_and(|old| old == bytes) {
        return Ok(target);
    }
    let dir = state_dir.join("bin");
    std::fs::create_dir_all(&dir).map_err(|cause| InstallError::CreateDir {
        dir: dir.clone(),
        cause,
    })?;
    fsutil::write_atomic(&target, &bytes, 0o755)?;
    Ok(target)
}
