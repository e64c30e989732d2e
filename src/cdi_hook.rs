//! `gpuplane cdi-hook`: the agent's CDI hooks, which a container runtime runs (never a person):
//! `memory-limit` holds a share's container to its GPU memory (`gpuplane_node::cdi::hook`).

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use gpuplane_node::cdi::hook::{apply_memory_limit, MemoryLimit};
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct CdiHookArgs {
    #[command(subcommand)]
    hook: Hook,
}

#[derive(Subcommand)]
enum Hook {
    /// Limit the container's cgroup to part of a GPU's memory through the driver (a
    /// `createRuntime` hook: the container's state on stdin).
    MemoryLimit {
        /// The NVML library, as the host names it.
        #[arg(long, value_name = "PATH", default_value = "libnvidia-ml.so.1")]
        nvml_lib: PathBuf,
        /// The GPU's UUID.
        #[arg(long, value_name = "UUID")]
        device: String,
        /// The limit, in bytes.
        #[arg(long, value_name = "BYTES")]
        limit_bytes: u64,
        /// Where the host mounts cgroup v2 (NVIDIA's memory partitioning requires
        /// /sys/fs/cgroup; another root only for a test host that mounts it elsewhere).
        #[arg(
            long,
            value_name = "DIR",
            default_value = "/sys/fs/cgroup",
            hide = true
        )]
        cgroup_root: PathBuf,
    },
}

pub fn run(args: CdiHookArgs) -> Result<()> {
    match args.hook {
        Hook::MemoryLimit {
            nvml_lib,
            device,
            limit_bytes,
            cgroup_root,
        } => {
            let mut state = Vec::new();
            std::io::stdin()
                .read_to_end(&mut state)
                .context("reading the container state the runtime writes on stdin")?;
            let limit = MemoryLimit {
                nvml_lib,
                gpu: device,
                bytes: limit_bytes,
            };
            let cgroup = apply_memory_limit(&state, Path::new("/proc"), &cgroup_root, &limit)?;
            tracing::info!(cgroup = %cgroup.display(), gpu = %limit.gpu, bytes = limit.bytes, "held the container's cgroup to its GPU memory share");
            Ok(())
        }
    }
}
