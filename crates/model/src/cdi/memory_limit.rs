//! Holding a share's container to its GPU memory from outside the container: an OCI
//! `createRuntime` hook that sets the driver's per-cgroup memory limit on the container's own
//! cgroup before its first process runs.
//!
//! Why a hook: `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in a container's environment "only further
//! constrains" the MPS daemon's limit (NVIDIA's MPS documentation, "Environment Variables"), so
//! a container that unsets it gets the whole GPU. Drivers from r615 (CUDA 13.4) limit a cgroup's
//! GPU memory in the driver itself (`nvmlDeviceSetMemoryLimits_v1`, NVML change log "v610 to
//! v615"; docs.nvidia.com/deploy/mps "MPS v3 Memory Partitioning"): an allocation past the hard
//! limit fails with `CUDA_ERROR_OUT_OF_MEMORY` whatever the process's environment says. The
//! limit must be set on the container's real leaf cgroup after the runtime created it (that
//! page, "Hierarchy and Containers"), which is what a `createRuntime` hook sees: the runtime has
//! put the container's init process in its cgroup and runs the hook in the runtime's own
//! namespaces with the container's state on stdin (OCI runtime spec, "Lifecycle" and
//! "POSIX-platform Hooks"). NVIDIA's container toolkit applies the same limit through a CDI hook.
//!
//! What is pure here: the hook's argv, and reading the runtime's state and `/proc/<pid>/cgroup`.

use super::spec::Hook;
use serde::Deserialize;

/// The agent's subcommand a memory-limit hook runs (`gpuplane cdi-hook memory-limit ...`).
pub const HOOK_ARGS: [&str; 2] = ["cdi-hook", "memory-limit"];

/// Where a node's memory-limit hooks find what they run, as the host names it (the hook runs
/// in the runtime's namespaces, not the agent's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLimitHook {
    /// The agent's executable, installed where the host can run it.
    pub exe: String,
    /// The NVML library the hook loads (a path, or `libnvidia-ml.so.1` for the loader's).
    pub nvml_lib: String,
}

impl MemoryLimitHook {
    /// The hook that holds a container to `bytes` of GPU `gpu`'s memory (soft and hard limit
    /// alike: the scheduler guarantees the share, so nothing is borrowed past it).
    pub fn hook(&self, gpu: &str, bytes: u64) -> Hook {
        let mut args = vec!["gpuplane".to_string()];
        args.extend(HOOK_ARGS.iter().map(|s| s.to_string()));
        args.extend([
            "--nvml-lib".to_string(),
            self.nvml_lib.clone(),
            "--device".to_string(),
            gpu.to_string(),
            "--limit-bytes".to_string(),
            bytes.to_string(),
        ]);
        Hook {
            hook_name: "createRuntime".to_string(),
            path: self.exe.clone(),
            args,
            env: Vec::new(),
        }
    }
}

/// The part of the container state a runtime passes a hook on stdin that the hook needs
/// (OCI runtime spec, "State": `id`, and `pid` once the container process exists).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ContainerState {
    pub id: String,
    #[serde(default)]
    pub pid: Option<u32>,
}

/// The cgroup v2 path in `/proc/<pid>/cgroup` text (the `0::<path>` line), relative to the
/// reader's cgroup root. `None` on a cgroup v1 host, where NVIDIA's memory partitioning does not
/// run ("requires Linux with cgroup v2 mounted at /sys/fs/cgroup").
pub fn cgroup_v2_path(proc_cgroup: &str) -> Option<&str> {
    proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::trim)
        .filter(|p| p.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hook_runs_the_agent_with_the_share() {
        let h = MemoryLimitHook {
            exe: "/var/lib/gpuplane/bin/gpuplane".into(),
            nvml_lib: "/run/nvidia/driver/usr/lib/libnvidia-ml.so.1".into(),
        };
        let hook = h.hook("GPU-1", 4 << 30);
        assert_eq!(hook.hook_name, "createRuntime");
        assert_eq!(hook.path, "/var/lib/gpuplane/bin/gpuplane");
        assert_eq!(
            hook.args.join(" "),
            "gpuplane cdi-hook memory-limit --nvml-lib /run/nvidia/driver/usr/lib/libnvidia-ml.so.1 --device GPU-1 --limit-bytes 4294967296"
        );
    }

    #[test]
    fn the_cgroup_is_the_unified_line() {
        let v2 = "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope\n";
        assert_eq!(
            cgroup_v2_path(v2),
            Some("/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope")
        );
        let hybrid = "12:memory:/docker/x\n0::/\n";
        assert_eq!(cgroup_v2_path(hybrid), Some("/"));
        assert_eq!(cgroup_v2_path("12:memory:/docker/x\n"), None);
        let state: ContainerState = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":42,"bundle":"/b"}"#,
        )
        .unwrap();
        assert_eq!(state.pid, Some(42));
    }
}
