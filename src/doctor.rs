//! `gpuplane doctor`: its flags (the agent's path flags, containerd's config, the agent's
//! address, the smoke pods') and the report printed; the checks are `gpuplane_node::doctor`'s.

use crate::source_args::SourceArgs;
use crate::Output;
use anyhow::{Context, Result};
use gpuplane_node::paths::HostPaths;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    node: NodeArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    output: Output,
}

/// Where the node checks look: the agent's path flags, containerd's config, the agent.
#[derive(clap::Args)]
struct NodeArgs {
    #[command(flatten)]
    host: crate::host_paths::HostPathArgs,
    /// The kernel's /proc (MIG capability minors).
    #[arg(long, default_value_os_t = HostPaths::standard().proc_root)]
    proc_root: PathBuf,
    /// containerd's config file.
    #[arg(long, default_value = "/etc/containerd/config.toml")]
    containerd_config: PathBuf,
    /// The running agent's --metrics-addr, to check its /readyz (e.g. 127.0.0.1:9400).
    #[arg(long, value_name = "ADDR")]
    agent_addr: Option<std::net::SocketAddr>,
    #[command(flatten)]
    source: SourceArgs,
}

/// The checks through the API server: this node's agent pod and ResourceSlices, and with
/// `--smoke` a pod with one GPU through each kubelet API on this node.
#[derive(clap::Args)]
struct ClusterArgs {
    /// Only the checks through the API server (agent-pod, slices, smoke), for a node named
    /// with --node-name: the doctor run against a cluster from outside the node.
    #[arg(long, requires = "node_name")]
    api_only: bool,
    /// The namespace the agents' DaemonSet runs in.
    #[arg(
        long,
        env = "POD_NAMESPACE",
        value_name = "NS",
        default_value = "gpuplane-system"
    )]
    agent_namespace: String,
    /// Also run a smoke pod with one GPU through each kubelet API on this node (needs API
    /// access that may create pods and resourceclaims: an admin's --kubeconfig).
    #[arg(long)]
    smoke: bool,
    /// Kubeconfig for the API checks (default: in-cluster, then KUBECONFIG, then ~/.kube/config).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// This node's name: its ResourceSlices are checked, the smoke pods run on it. Unset: no
    /// API checks.
    #[arg(
        long,
        env = "NODE_NAME",
        value_name = "NODE",
        required_if_eq("smoke", "true")
    )]
    node_name: Option<String>,
    /// The DRA driver whose slices are checked.
    #[arg(long, value_name = "NAME", default_value = "gpu.gpuplane.dev")]
    driver_name: String,
    /// The smoke pods' namespace.
    #[arg(long, value_name = "NS", default_value = "default")]
    smoke_namespace: String,
    /// The smoke pods' image (it needs `sh`).
    #[arg(long, value_name = "IMAGE", default_value = "busybox:1.36")]
    smoke_image: String,
    /// The device-plugin resource the first pod asks for.
    #[arg(long, value_name = "NAME", default_value = "nvidia.com/gpu")]
    smoke_resource: String,
    /// The DeviceClass the second pod's claim asks for.
    #[arg(long, value_name = "NAME", default_value = "gpu.gpuplane.dev")]
    smoke_device_class: String,
    /// How long each smoke pod may take.
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = gpuplane_cluster::controller::hours::parse_duration)]
    smoke_timeout: std::time::Duration,
}

impl ClusterArgs {
    /// The API checks, when a node is named: the agent's pod unless `agent_checked` (its
    /// /readyz was asked directly), the slices always, the smoke pods when asked.
    fn run(self, agent_checked: bool) -> Result<Vec<gpuplane_node::doctor::Check>> {
        use gpuplane_node::doctor::{agent_pod, slices, smoke, Check};
        let Some(node) = self.node_name else {
            return Ok(Vec::new());
        };
        let opts = smoke::SmokeOptions {
            node: node.clone(),
            namespace: self.smoke_namespace,
            image: self.smoke_image,
            resource: self.smoke_resource,
            device_class: self.smoke_device_class,
            timeout: self.smoke_timeout,
        };
        let names = [
            (!agent_checked).then_some("agent-pod"),
            Some("slices"),
            self.smoke.then_some("smoke"),
        ];
        let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
        runtime.block_on(async {
            let client = match gpuplane_common::kubeclient::client(self.kubeconfig.as_deref()).await
            {
                Ok(c) => c,
                Err(e) => {
                    let why = format!("no API access: {e:#}");
                    let fix =
                        "pass --kubeconfig, or unset --node-name/NODE_NAME to skip the API checks";
                    return Ok(names
                        .into_iter()
                        .flatten()
                        .map(|n| Check::fail(n, why.clone(), fix))
                        .collect());
                }
            };
            let mut out = Vec::new();
            if !agent_checked {
                out.push(agent_pod::agent_pod(client.clone(), &node, &self.agent_namespace).await);
            }
            out.push(slices::slices(client.clone(), &node, &self.driver_name).await);
            if self.smoke {
                out.extend(smoke::smoke(client, &opts).await);
            }
            Ok(out)
        })
    }
}

pub fn run(args: DoctorArgs) -> Result<()> {
    let agent_checked = !args.cluster.api_only && args.node.agent_addr.is_some();
    let mut report = if args.cluster.api_only {
        gpuplane_node::doctor::Report { checks: Vec::new() }
    } else {
        args.node.examine()
    };
    report.checks.extend(args.cluster.run(agent_checked)?);
    match args.output {
        Output::Table => print!("{}", report.text()),
        Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
    }
    let failed = report.failed();
    anyhow::ensure!(
        failed == 0,
        "{failed} doctor check(s) failed; each says what to fix"
    );
    Ok(())
}

impl NodeArgs {
    /// The checks of this node's files, devices, kubelet, runtime and agent.
    fn examine(self) -> gpuplane_node::doctor::Report {
        let opts = gpuplane_node::doctor::DoctorOptions {
            paths: self
                .host
                .paths(HostPaths::standard().state_dir, self.proc_root),
            mode: self.source.mode(),
            containerd_config: self.containerd_config,
            agent_addr: self.agent_addr,
        };
        let opened = self.source.open().map_err(|e| format!("{e:#}"));
        let source = opened
            .as_ref()
            .map(|(s, _)| s.as_ref())
            .map_err(Clone::clone);
        gpuplane_node::doctor::examine(&opts, source)
    }
}
