//! The `gpuplane` command line: parses arguments, picks a device source, runs a face.

#![forbid(unsafe_code)]
// No panics on what a user, peer or file can influence: a check, not a habit.
#![deny(clippy::unwrap_used, clippy::expect_used)]

mod cdi_hook;
mod doctor;
mod host_paths;
mod hours;
mod mps;
mod source_args;

use source_args::SourceArgs;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use gpuplane_node::node::apis::{self, Apis};
use gpuplane_node::paths::HostPaths;
use gpuplane_node::telemetry::idle::IdlePolicy;
use gpuplane_node::telemetry::TelemetryOptions;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "gpuplane",
    version,
    about = "GPU node agent and quota controller for Kubernetes"
)]
struct Cli {
    /// Log format on stderr: human-readable text, or one JSON object per line for log
    /// pipelines.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Show the GPUs, MIG devices and topology of this node (or of a simulated one).
    Discover {
        #[command(flatten)]
        source: SourceArgs,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Whether this node is ready for gpuplane: NVML, the driver's files and device nodes, the
    /// kubelet's sockets, CDI in containerd, MPS, MIG, the running agent. One line per check
    /// with what to fix; exits non-zero when one fails.
    Doctor(Box<doctor::DoctorArgs>),
    /// Run the node agent: serve this node's GPUs, MIG devices and shares to the kubelet through
    /// both the device plugin API and DRA, from one inventory.
    Node(Box<NodeArgs>),
    /// One MPS control daemon, as its pod runs it (the agent creates those pods).
    MpsDaemon(mps::DaemonArgs),
    /// A CDI hook of the agent's, as a container runtime runs it.
    CdiHook(cdi_hook::CdiHookArgs),
    /// Run the cluster-side controller: GPU quotas (admission webhook, queueing with scheduling
    /// gates, preemption), "why Pending" answers and the GPU-hours ledger.
    Controller(Box<ControllerArgs>),
    /// Why a GPU pod is Pending: one reason with its numbers, read from the API server.
    Explain(ExplainArgs),
    /// GPU-hours per tenant over a window, from the controller's ledger.
    Report {
        #[command(flatten)]
        args: hours::ReportArgs,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// The whole product on a simulated machine in one process, no cluster: agent, kubelet and
    /// API server doubles, quota webhook and controller, narrating a short story.
    #[cfg(feature = "demo")]
    Demo(DemoArgs),
}

#[cfg(feature = "demo")]
#[derive(clap::Args)]
struct DemoArgs {
    /// The machine: a bundled profile name (dgx-a100, dgx-h100, dgx1-v100, pcie-l4x4,
    /// a100-mig-mixed, h100-mig-single, dynamic-mig-mixed) or the path of a profile file.
    #[arg(long, value_name = "PROFILE", default_value = "dgx-h100")]
    profile: String,
    /// Format of the closing summary (json: the narrative goes to stderr, the summary alone to
    /// stdout).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    output: Output,
}

#[derive(clap::Args)]
struct ControllerArgs {
    /// Kubeconfig for API access (default: in-cluster, then KUBECONFIG).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Where the admission webhook serves HTTPS.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:9443")]
    webhook_addr: std::net::SocketAddr,
    /// PEM certificate chain of the webhook (reloaded when it changes).
    #[arg(long, value_name = "FILE")]
    tls_cert_file: PathBuf,
    /// PEM private key of the webhook (reloaded when it changes).
    #[arg(long, value_name = "FILE")]
    tls_key_file: PathBuf,
    /// Where to serve /metrics, /healthz and /readyz over plain HTTP.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// The controller's own namespace (its service account may remove scheduling gates).
    #[arg(long, env = "POD_NAMESPACE", default_value = "gpuplane-system")]
    namespace: String,
    /// Run the controller loops only while holding the leader lease.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    leader_elect: bool,
    /// DRA drivers whose devices are GPUs (repeatable).
    #[arg(
        long = "driver-name",
        value_name = "NAME",
        default_value = "gpu.gpuplane.dev"
    )]
    driver_names: Vec<String>,
    /// A time-sliced device-plugin resource and its replicas, as in the agents' config,
    /// e.g. nvidia.com/gpu=4 (repeatable).
    #[arg(long = "time-sliced", value_name = "RESOURCE=REPLICAS", value_parser = parse_time_sliced)]
    time_sliced: Vec<(String, u32)>,
    /// Kueue runs in this cluster: the GPU pods it governs (label kueue.x-k8s.io/queue-name,
    /// its admission gate, the pods of jobs it admitted) are its alone: never gated, charged
    /// or preempted by a GpuQuota, and explained with Kueue's own reason. Without it, such a
    /// pod in a namespace with a GpuQuota is refused (docs/kueue.md).
    #[arg(long)]
    kueue: bool,
    #[command(flatten)]
    hours: hours::HoursArgs,
}

#[derive(clap::Args)]
struct ExplainArgs {
    #[command(subcommand)]
    what: ExplainWhat,
    /// Kubeconfig for API access (default: in-cluster, then KUBECONFIG, then ~/.kube/config).
    #[arg(long, value_name = "FILE", global = true)]
    kubeconfig: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table, global = true)]
    output: Output,
    /// A time-sliced device-plugin resource and its replicas, as in the agents' config, so its
    /// name counts as a GPU resource (repeatable).
    #[arg(long = "time-sliced", value_name = "RESOURCE=REPLICAS", value_parser = parse_time_sliced, global = true)]
    time_sliced: Vec<(String, u32)>,
    /// Compute every answer from the cluster now, even for pods carrying the controller's
    /// (condition gpuplane.dev/GPUsAvailable, current within about two seconds): reads every
    /// node, bound pod, ResourceSlice and claim.
    #[arg(long, global = true)]
    live: bool,
}

#[derive(Subcommand)]
enum ExplainWhat {
    /// One pod.
    Pod {
        #[arg(value_name = "NAMESPACE/NAME", value_parser = parse_pod_ref)]
        pod: (String, String),
    },
    /// Every Pending pod of a namespace, and the jobs Kueue holds there before their pods exist.
    Namespace { namespace: String },
    /// A Job: Kueue's answer while Kueue holds it, else its Pending pods'.
    Job {
        #[arg(value_name = "NAMESPACE/NAME", value_parser = parse_pod_ref)]
        job: (String, String),
    },
}

fn parse_pod_ref(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_string(), name.to_string()))
        }
        _ => Err(format!(
            "{s:?}: expected NAMESPACE/NAME, e.g. team-a/train-0"
        )),
    }
}

fn parse_time_sliced(s: &str) -> Result<(String, u32), String> {
    let (name, n) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected RESOURCE=REPLICAS"))?;
    let n: u32 = n
        .parse()
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| format!("{s:?}: replicas must be a positive integer"))?;
    Ok((name.to_string(), n))
}

#[derive(clap::Args)]
struct NodeArgs {
    /// This node's name (the pool name of its devices).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    #[command(flatten)]
    host: host_paths::HostPathArgs,
    /// The agent's durable state.
    #[arg(long, default_value_os_t = HostPaths::standard().state_dir)]
    state_dir: PathBuf,
    /// Agent config file (YAML); reloaded on SIGHUP or when it changes.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Serve the kubelet device plugin API.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    device_plugin: bool,
    /// Serve the DRA driver (ResourceSlices, NodePrepareResources). Default: on when API access
    /// is configured (in-cluster, KUBECONFIG or --kubeconfig).
    #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    dra: Option<bool>,
    /// Kubeconfig for API access (default: in-cluster, then KUBECONFIG).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Serve /metrics, /healthz and /readyz on this address (e.g. 0.0.0.0:9400).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// The DRA driver name; `gpu.nvidia.com` makes gpuplane a drop-in for NVIDIA's driver.
    #[arg(long, default_value = "gpu.gpuplane.dev")]
    driver_name: String,
    /// Simulate the bundled profile the node's label `gpuplane.dev/simulate` names (e.g.
    /// dgx-h100), read at start; a node without the label uses --simulate/--nvml-lib as given.
    /// Lets one DaemonSet serve different simulated machines (needs API access).
    #[arg(long)]
    simulate_from_node_label: bool,
    /// Sample every GPU and MIG device this often for /metrics (10s, 500ms); 0 turns device
    /// telemetry off.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = interval)]
    telemetry_interval: std::time::Duration,
    /// The host's /proc, mounted read-only (e.g. /host/proc): each GPU process's cgroup names
    /// its pod and container. Without it GPU processes are counted but not attributed.
    #[arg(long, value_name = "DIR")]
    host_proc: Option<PathBuf>,
    /// A held GPU or MIG device under --idle-below busy this long gets one Event on its pod
    /// and shows in gpuplane_held_device_idle_seconds (30m, 2h). Default: off.
    #[arg(long, value_name = "DURATION", value_parser = interval)]
    idle_after: Option<std::time::Duration>,
    /// Percent busy under which a held device counts as idle.
    #[arg(long, value_name = "PERCENT", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    idle_below: u32,
    /// What a simulated machine's devices are doing: a telemetry file (the fake
    /// libnvidia-ml's format, docs/telemetry.md), read again whenever it changes. Simulated
    /// machines only (--simulate, --simulate-from-node-label).
    #[arg(long, value_name = "FILE")]
    simulate_telemetry: Option<PathBuf>,
    #[command(flatten)]
    source: SourceArgs,
    #[command(flatten)]
    mps: mps::NodeMpsArgs,
}

fn interval(s: &str) -> Result<std::time::Duration, String> {
    gpuplane_model::config::parse_duration(s)
        .ok_or_else(|| format!("{s:?}: expected a duration such as 10s, 500ms or 0"))
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let format = cli.log_format;
    // The demo's story is its stdout. Its refusals and Xids are logged as warnings by design
    // and the story already tells them, so only errors are logged unless RUST_LOG says more.
    let default_level = match cli.command {
        #[cfg(feature = "demo")]
        Command::Demo(_) => "error",
        _ => "info",
    };
    // Colour only for a person at a terminal: `kubectl logs` and log collectors read the
    // escape sequences as text. NO_COLOR (no-color.org) turns it off there too.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        );
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // With JSON logs every stderr line must be JSON, the final error included.
            match format {
                LogFormat::Text => eprintln!("error: {e:#}"),
                LogFormat::Json => tracing::error!(error = %format!("{e:#}"), "gpuplane failed"),
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Discover { source, output } => {
            let (source, label) = source.open()?;
            let found = source.discover().context("discovering devices")?;
            let text = match output {
                Output::Table => gpuplane_node::discover::render_table(&label, &found),
                Output::Json => gpuplane_node::discover::render_json(&label, &found)?,
            };
            print!("{text}");
            Ok(())
        }
        Command::Doctor(args) => doctor::run(*args),
        Command::Node(args) => run_node(*args),
        Command::Controller(args) => run_controller(*args),
        Command::MpsDaemon(args) => mps::run_daemon(args),
        Command::CdiHook(args) => cdi_hook::run(args),
        Command::Explain(args) => run_explain(args),
        Command::Report { args, output } => {
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let report = runtime.block_on(async {
                let client =
                    gpuplane_common::kubeclient::client(args.kubeconfig.as_deref()).await?;
                anyhow::Ok(
                    gpuplane_cluster::controller::meter::report(&client, &args.query()).await?,
                )
            })?;
            match output {
                Output::Table => print!("{}", report.table()),
                Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
            }
            Ok(())
        }
        #[cfg(feature = "demo")]
        Command::Demo(args) => run_demo(args),
    }
}

fn run_explain(args: ExplainArgs) -> Result<()> {
    use gpuplane_cluster::explain_cli;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let settings = gpuplane_model::quota::CatalogSettings {
        time_slicing: args.time_sliced.into_iter().collect(),
        ..Default::default()
    };
    let answers = runtime.block_on(async {
        let client = gpuplane_common::kubeclient::client(args.kubeconfig.as_deref()).await?;
        let answers = match &args.what {
            ExplainWhat::Pod { pod: (ns, name) } => {
                vec![explain_cli::pod(&client, settings, ns, name, args.live).await?]
            }
            ExplainWhat::Namespace { namespace } => {
                explain_cli::namespace(&client, settings, namespace, args.live).await?
            }
            ExplainWhat::Job { job: (ns, name) } => {
                explain_cli::job(&client, settings, ns, name, args.live).await?
            }
        };
        anyhow::Ok(answers)
    })?;
    match (args.output, &args.what) {
        (Output::Json, ExplainWhat::Pod { .. }) => {
            println!("{}", serde_json::to_string_pretty(&answers.first())?)
        }
        (Output::Json, ExplainWhat::Namespace { .. } | ExplainWhat::Job { .. }) => {
            println!("{}", serde_json::to_string_pretty(&answers)?)
        }
        (Output::Table, _) => print!("{}", explain_cli::render_table(&answers)),
    }
    Ok(())
}

#[cfg(feature = "demo")]
fn run_demo(args: DemoArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let opts = gpuplane_testkit::demo::DemoOptions {
        profile: args.profile,
    };
    let summary = runtime.block_on(async {
        match args.output {
            Output::Table => gpuplane_testkit::demo::run(&opts, &mut std::io::stdout()).await,
            Output::Json => gpuplane_testkit::demo::run(&opts, &mut std::io::stderr()).await,
        }
    })?;
    match args.output {
        Output::Table => print!("{}", summary.render_table()),
        Output::Json => println!("{}", serde_json::to_string_pretty(&summary.to_json())?),
    }
    if !summary.ok() {
        let failed: Vec<&str> = summary.failed().iter().map(|s| s.key()).collect();
        anyhow::bail!(
            "the demo did not hold: {}",
            if failed.is_empty() {
                summary.verdict()
            } else {
                format!("step(s) {}", failed.join(", "))
            }
        );
    }
    Ok(())
}

fn run_controller(args: ControllerArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let client = gpuplane_common::kubeclient::client_without_retry(args.kubeconfig.as_deref())
            .await
            .context("the controller needs API access")?;
        let mut opts = gpuplane_cluster::webhook::WebhookOptions::new(args.tls_cert_file, args.tls_key_file, &args.namespace);
        opts.addr = args.webhook_addr;
        opts.metrics_addr = args.metrics_addr;
        opts.catalog.drivers = args.driver_names;
        opts.catalog.time_slicing = args.time_sliced.into_iter().collect();
        opts.kueue = args.kueue;
        tracing::info!(namespace = %args.namespace, leader_elect = args.leader_elect, "gpuplane controller starting");
        // The webhook serves on every replica; the quota loops run on the Lease holder.
        let shutdown = termination()?;
        let host = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "gpuplane-controller".into());
        let identity = gpuplane_cluster::elector::identity(&host);
        opts.identity = identity.clone();
        let mut loops = gpuplane_cluster::controller::ControllerOptions::new(&args.namespace, &identity);
        loops.leader_elect = args.leader_elect;
        loops.queue.catalog = opts.catalog.clone();
        loops.queue.hours = Some(args.hours.options(&args.namespace)?);
        loops.queue.settings.kueue = args.kueue;
        gpuplane_cluster::replica::run(client, opts, loops, shutdown).await?;
        tracing::info!("gpuplane controller stopped");
        Ok(())
    })
}

fn run_node(mut args: NodeArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let api_configured =
            args.kubeconfig.is_some() || gpuplane_common::kubeclient::available_without_flags();
        let early_client = simulate_from_node_label(&mut args).await?;
        let boot_id = HostPaths::standard().boot_id();
        let (source, label) = args.source.open_for_agent(
            &args.state_dir,
            &boot_id,
            args.simulate_telemetry.as_deref(),
        )?;
        tracing::info!(node = %args.node_name, source = %label, mode = ?args.source.mode(), version = env!("CARGO_PKG_VERSION"), build = %build_stamp(), "gpuplane node starting");
        let flags = Apis {
            device_plugin: args.device_plugin,
            dra: args.dra.unwrap_or(api_configured),
        };
        let client = match early_client {
            Some(client) => Some(client),
            None => node_client(&args, flags, api_configured).await?,
        };
        // The node's label may choose other APIs than the flags.
        let serving = match &client {
            Some(c) => apis::resolve(c, &args.node_name, flags).await?,
            None => apis::Serving {
                apis: flags,
                sharing: None,
            },
        };
        let opts = node_options(args, client.clone(), &serving)?;
        let terminated = termination()?;
        let node = opts.node_name.clone();
        let stop = async move {
            match client {
                Some(client) => tokio::select! {
                    _ = terminated => {}
                    _ = apis::changed(client, node, flags, serving) => {}
                },
                None => terminated.await,
            }
        };
        gpuplane_node::node::run(opts, Arc::from(source), stop).await?;
        tracing::info!("gpuplane node stopped");
        Ok(())
    })
}

/// `--simulate-from-node-label`: the profile the Node's label names replaces the device source
/// flags. The client made to read the label, to be used for everything after.
async fn simulate_from_node_label(
    args: &mut NodeArgs,
) -> Result<Option<gpuplane_common::kubeclient::Client>> {
    if !args.simulate_from_node_label {
        return Ok(None);
    }
    let client = gpuplane_common::kubeclient::client(args.kubeconfig.as_deref())
        .await
        .context("--simulate-from-node-label needs API access")?;
    if let Some(profile) =
        gpuplane_node::node::simulate::profile_from_label(&client, &args.node_name).await?
    {
        args.source.simulate = Some(profile);
        args.source.nvml_lib = None;
    }
    Ok(Some(client))
}

/// The agent's API client: needed for DRA, and used for labels and the APIs label whenever
/// the API server is configured; `None` on a node without one.
async fn node_client(
    args: &NodeArgs,
    flags: Apis,
    api_configured: bool,
) -> Result<Option<gpuplane_common::kubeclient::Client>> {
    if !flags.dra && !api_configured {
        return Ok(None);
    }
    let client = gpuplane_common::kubeclient::client(args.kubeconfig.as_deref())
        .await
        .context(if flags.dra {
            "--dra needs API access"
        } else {
            "connecting to the API server (--kubeconfig or in-cluster)"
        })?;
    Ok(Some(client))
}

/// The agent's options from the flags and the APIs this node serves.
fn node_options(
    args: NodeArgs,
    client: Option<gpuplane_common::kubeclient::Client>,
    serving: &apis::Serving,
) -> Result<gpuplane_node::node::NodeOptions> {
    let real_nvml = args.source.simulate.is_none();
    let own_pod = args
        .mps
        .pods(args.source.nvml_lib.clone().filter(|_| real_nvml))?;
    let dra = match (&client, serving.apis.dra) {
        (Some(client), true) => Some(gpuplane_node::node::dra::DraSettings {
            driver_name: args.driver_name,
            client: client.clone(),
            mps_pods: own_pod,
        }),
        _ => None,
    };
    Ok(gpuplane_node::node::NodeOptions {
        node_name: args.node_name,
        paths: args
            .host
            .paths(args.state_dir, HostPaths::standard().proc_root),
        config_file: args.config,
        sharing_switch: serving.sharing,
        device_plugin: serving.apis.device_plugin,
        dra,
        api: client,
        metrics_addr: args.metrics_addr,
        device_mode: args.source.mode(),
        telemetry: (!args.telemetry_interval.is_zero()).then_some(TelemetryOptions {
            interval: args.telemetry_interval,
            host_proc: args.host_proc,
            idle: args.idle_after.map(|after| IdlePolicy {
                below_percent: args.idle_below,
                after,
            }),
        }),
    })
}

/// The image build's stamp (`GPUPLANE_BUILD`, set by the image), so the logs of a rollout show
/// which build each agent is; empty when not in such an image.
fn build_stamp() -> String {
    std::env::var("GPUPLANE_BUILD").unwrap_or_default()
}

/// Resolves on SIGTERM (how Kubernetes stops a pod) or SIGINT.
pub(crate) fn termination() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    })
}
