//! The MPS flags: where the node agent runs its MPS control daemons (`gpuplane node
//! --mps-daemons`), and `gpuplane mps-daemon`, what a daemon pod runs.

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use gpuplane_node::mps::pods::PodSettings;
use std::path::PathBuf;

/// Where the agent runs MPS control daemons.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DaemonsIn {
    /// As the agent's own processes: for an agent run as a host process. They share its
    /// cgroup: stopping the agent's cgroup stops every share.
    Agent,
    /// In pods of their own (the DaemonSet's choice): an agent upgrade, eviction or crash
    /// leaves running shares alone. Needs POD_NAME and POD_NAMESPACE.
    Pods,
}

/// The node agent's MPS flags.
#[derive(Args)]
pub struct NodeMpsArgs {
    /// Where MPS control daemons run.
    #[arg(long, value_enum, default_value_t = DaemonsIn::Agent)]
    mps_daemons: DaemonsIn,
    /// The agent's own pod (downward API metadata.name): daemon pods copy its image.
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pod_name: Option<String>,
    /// The agent's own namespace (downward API metadata.namespace): daemon pods live there.
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pod_namespace: Option<String>,
}

impl NodeMpsArgs {
    /// The daemon pods' settings when daemons run in pods (`nvml_lib`: the agent's, when its
    /// devices are real); an error says what is missing.
    pub fn pods(&self, nvml_lib: Option<PathBuf>) -> Result<Option<PodSettings>> {
        if self.mps_daemons == DaemonsIn::Agent {
            return Ok(None);
        }
        match (&self.pod_namespace, &self.pod_name) {
            (Some(namespace), Some(name)) => Ok(Some(PodSettings {
                namespace: namespace.clone(),
                name: name.clone(),
                nvml_lib,
            })),
            _ => anyhow::bail!(
                "--mps-daemons=pods needs the agent's own pod: set POD_NAME and POD_NAMESPACE \
                 from the downward API (metadata.name, metadata.namespace), as the DaemonSet \
                 does, or pass --pod-name and --pod-namespace"
            ),
        }
    }
}

/// `gpuplane mps-daemon`: one shared unit's MPS control daemon, run by its pod.
#[derive(Args)]
pub struct DaemonArgs {
    /// The GPU or MIG device UUID the daemon serves.
    #[arg(long)]
    unit: String,
    /// The agent's state directory (the daemon's files are under `mps/<unit>/`).
    #[arg(long)]
    state_dir: PathBuf,
    /// Where the driver's files are mounted in this container.
    #[arg(long, value_name = "DIR")]
    driver_root_mount: PathBuf,
    /// Serve every user from one MPS server (`-M`; Volta and later).
    #[arg(long)]
    multiuser: bool,
    /// The driver's libnvidia-ml: the GPU is in compute mode EXCLUSIVE_PROCESS while the
    /// daemon serves it. Without it the compute mode is left alone (simulated devices).
    #[arg(long, value_name = "PATH")]
    nvml_lib: Option<PathBuf>,
}

pub fn run_daemon(args: DaemonArgs) -> Result<()> {
    use gpuplane_node::mps::daemon;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let opts = daemon::DaemonOptions {
            unit: args.unit,
            state_dir: args.state_dir,
            driver_files: args.driver_root_mount,
            proc_root: PathBuf::from("/proc"),
            multiuser: args.multiuser,
            nvml_lib: args.nvml_lib,
        };
        let stop = crate::termination()?;
        daemon::serve(opts, stop).await?;
        Ok(())
    })
}
