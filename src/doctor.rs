//! `gpuplane doctor`: its flags (the agent's path flags, containerd's config, the agent's
//! address) and the report printed; the checks are `gpuplane_node::doctor`'s.

use crate::source_args::SourceArgs;
use crate::Output;
use anyhow::Result;
use gpuplane_node::paths::HostPaths;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DoctorArgs {
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
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    output: Output,
}

pub fn run(args: DoctorArgs) -> Result<()> {
    let opts = gpuplane_node::doctor::DoctorOptions {
        paths: args
            .host
            .paths(HostPaths::standard().state_dir, args.proc_root),
        mode: args.source.mode(),
        containerd_config: args.containerd_config,
        agent_addr: args.agent_addr,
    };
    let opened = args.source.open().map_err(|e| format!("{e:#}"));
    let source = opened
        .as_ref()
        .map(|(s, _)| s.as_ref())
        .map_err(Clone::clone);
    let report = gpuplane_node::doctor::examine(&opts, source);
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
