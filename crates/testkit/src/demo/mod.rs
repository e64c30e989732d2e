//! `gpuplane demo`: the whole product on a simulated machine in one process, no cluster.
//!
//! The real node agent ([`gpuplane_node::node::run`], device plugin and DRA over one ledger) runs on a
//! [`SimSource`] inside a [`NodeLab`] (kubelet doubles over unix sockets, the API server double
//! over HTTP, all in a temp dir); the real quota webhook serves HTTPS with a certificate made in
//! process and the real controller loops run against the same API server double. [`steps`] then
//! tells a short story through real calls and judges each step from the answers; [`summary`]
//! lays the outcomes out. The narrative goes to the writer the caller passes; the summary is
//! returned for the caller to render.

pub mod facts;
pub mod steps;
pub mod summary;
pub mod tls;

use crate::doubles::kubelet_dra::KubeletDraOptions;
use crate::doubles::lab::{LabError, NodeLab, RunningAgent, DRIVER, NODE};
use gpuplane_cluster::controller::hours::HoursSettings;
use gpuplane_cluster::controller::meter::HoursOptions;
use gpuplane_cluster::controller::namespace::QueueSettings;
use gpuplane_cluster::controller::queue::QueueOptions;
use gpuplane_cluster::controller::ControllerOptions;
use gpuplane_cluster::controller_metrics::QueueMetrics;
use gpuplane_cluster::elector::ElectionError;
use gpuplane_cluster::webhook::{RunningWebhook, WebhookError, WebhookOptions};
use gpuplane_model::inventory::Inventory;
use gpuplane_model::quota::{GpuQuota, GpuQuotaSpec, Gpus, Limits, QuotaMode};
use gpuplane_model::report::chain;
use gpuplane_model::sim::ProfileError;
use gpuplane_model::source::SimSource;
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::api::{Api, PostParams};
use serde::Deserialize;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use summary::{StepResult, Summary};
use tls::{DemoPki, TlsError};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long the agent may take to register with both kubelet APIs.
const START_WAIT: Duration = Duration::from_secs(15);
/// The agent's quiet period before a device unhealthy by Xid is healthy again: short, so the
/// recovery step finishes in seconds (the product's default is 5 minutes).
pub const RECOVERY_QUIET_PERIOD: Duration = Duration::from_secs(2);

/// What to run the demo on.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// A bundled profile name or the path of a profile file.
    pub profile: String,
}

/// Why the demo could not run at all (a step that does not hold is an outcome, not an error).
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("creating the demo's temp dir: {}", chain(.0))]
    TempDir(std::io::Error),
    #[error(transparent)]
    Lab(#[from] LabError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("starting the quota webhook: {}", chain(.0))]
    Webhook(WebhookError),
    #[error("daemonset/deviceclasses.yaml: {0}")]
    DeviceClasses(serde_yaml_ng::Error),
    #[error("creating DeviceClass {name}: {}", chain(.cause))]
    DeviceClass { name: String, cause: kube::Error },
    #[error("the demo's GpuQuota specs: {0}")]
    QuotaSpec(serde_json::Error),
    #[error("creating GpuQuota {name}: {}", chain(.cause))]
    Quota { name: String, cause: kube::Error },
    #[error("the node agent did not come up: {0}")]
    AgentStart(String),
}

gpuplane_model::causes_from!(DemoError { Webhook(WebhookError) });

/// The narrative: indented lines under numbered headings.
pub struct Narrator<'w> {
    out: &'w mut dyn Write,
}

impl<'w> Narrator<'w> {
    pub fn new(out: &'w mut dyn Write) -> Self {
        Narrator { out }
    }

    /// One line of the story. A reader that went away (closed pipe) does not stop the demo:
    /// the summary still decides the exit status.
    pub fn say(&mut self, text: impl AsRef<str>) {
        let _ = writeln!(self.out, "   {}", text.as_ref());
    }

    fn raw(&mut self, text: impl AsRef<str>) {
        let _ = writeln!(self.out, "{}", text.as_ref());
    }
}

/// The agent config the demo runs with: MIG devices offered one resource per profile when the
/// machine has any (so every unit is visible to both APIs), a short recovery quiet period, the
/// last GPU with MIG off shared through consumable capacity (1Gi and 10% steps), and the GPUs
/// in MIG mode without instances cut by dynamic MIG.
pub fn agent_config(inv: &Inventory) -> String {
    let mig = if inv.gpus.iter().any(|g| g.mig.current) {
        "mixed"
    } else {
        "none"
    };
    let mut config = format!(
        "version: v1\nflags:\n  migStrategy: {mig}\nhealth:\n  recoveryQuietPeriod: {}ms\n",
        RECOVERY_QUIET_PERIOD.as_millis()
    );
    if let Some(i) = shared_gpu(inv) {
        config.push_str(&format!(
            "sharing:\n  consumableCapacity:\n    gpus: [{i}]\n    memoryStep: 1Gi\n    computeStep: 10\n"
        ));
    }
    let dynamic = dynamic_gpus(inv);
    if !dynamic.is_empty() {
        let list: Vec<String> = dynamic.iter().map(u32::to_string).collect();
        config.push_str(&format!("dynamicMig:\n  gpus: [{}]\n", list.join(", ")));
    }
    config
}

/// The GPU the share step shares: the last one with MIG off (the other steps take GPUs from
/// the first).
pub fn shared_gpu(inv: &Inventory) -> Option<u32> {
    inv.gpus
        .iter()
        .filter(|g| !g.mig.current)
        .map(|g| g.index)
        .max()
}

/// The GPUs in MIG mode with no MIG instances: gpuplane cuts them claim by claim.
pub fn dynamic_gpus(inv: &Inventory) -> Vec<u32> {
    inv.gpus
        .iter()
        .filter(|g| g.mig.current && g.mig_devices.is_empty())
        .map(|g| g.index)
        .collect()
}

/// The namespaces and GpuQuotas of the quota steps.
pub const REJECT_NAMESPACE: &str = "team-a";
pub const QUEUE_NAMESPACE: &str = "team-b";
pub const QUOTA_NAME: &str = "default";
/// GPUs of the Reject-mode quota (step 5) and the Queue-mode one (step 6).
pub const REJECT_GPUS: u64 = 2;
pub const QUEUE_GPUS: u64 = 4;
/// The GPU-share quota card's namespace: a Reject-mode GpuQuota of 20Gi of GPU memory and one
/// GPU (100%).
pub const SHARE_NAMESPACE: &str = "team-s";
/// The preemption step's namespace: a Queue-mode GpuQuota of [`PREEMPT_GPUS`] that lets a
/// waiting pod evict pods of lower priority.
pub const PREEMPT_NAMESPACE: &str = "team-p";
pub const PREEMPT_GPUS: u64 = 2;
/// The GPU-hours step's namespace, with a pod that ran before the controller started.
pub const HOURS_NAMESPACE: &str = "team-h";
/// Where the controller keeps the GPU-hours book.
pub const CONTROLLER_NAMESPACE: &str = "gpuplane-system";

fn whole_gpus(gpus: u64, mode: QuotaMode) -> GpuQuotaSpec {
    GpuQuotaSpec {
        hard: Limits {
            gpus: Some(Gpus::whole(gpus)),
            ..Limits::default()
        },
        mode,
        ..GpuQuotaSpec::default()
    }
}

/// The GpuQuotas of the steps, by namespace.
fn quotas() -> Result<Vec<(&'static str, GpuQuotaSpec)>, serde_json::Error> {
    let card = serde_json::from_value(
        serde_json::json!({"hard": {"gpuMemory": "20Gi", "gpus": 1}, "mode": "Reject"}),
    )?;
    let preempting = serde_json::from_value(serde_json::json!({
        "hard": {"gpus": PREEMPT_GPUS}, "mode": "Queue",
        "preemption": {"withinQuota": "LowerPriority"}
    }))?;
    Ok(vec![
        (REJECT_NAMESPACE, whole_gpus(REJECT_GPUS, QuotaMode::Reject)),
        (QUEUE_NAMESPACE, whole_gpus(QUEUE_GPUS, QuotaMode::Queue)),
        (SHARE_NAMESPACE, card),
        (PREEMPT_NAMESPACE, preempting),
        (HOURS_NAMESPACE, whole_gpus(8, QuotaMode::Reject)),
    ])
}

async fn create_quota(
    client: &kube::Client,
    namespace: &str,
    spec: GpuQuotaSpec,
) -> Result<(), DemoError> {
    Api::<GpuQuota>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &GpuQuota::new(QUOTA_NAME, spec))
        .await
        .map_err(|source| DemoError::Quota {
            name: format!("{namespace}/{QUOTA_NAME}"),
            cause: source,
        })?;
    Ok(())
}

/// Runs the whole demo, narrating into `out`, and returns how every step ended.
pub async fn run(opts: &DemoOptions, out: &mut dyn Write) -> Result<Summary, DemoError> {
    let started = Instant::now();
    let inventory = gpuplane_model::sim::load(&opts.profile)?;
    let dir = tempfile::Builder::new()
        .prefix("gpuplane-demo-")
        .tempdir()
        .map_err(DemoError::TempDir)?;
    let mut say = Narrator::new(out);
    say.raw(format!(
        "gpuplane demo: the whole product on a simulated {} in one process, no cluster",
        opts.profile
    ));
    say.say(format!(
        "node agent {NODE}: device plugin + DRA driver {DRIVER}, one allocation ledger"
    ));
    say.say("kubelet doubles on unix sockets, API server double over HTTP, quota webhook over HTTPS, controller loops");
    say.say(format!(
        "working dir {} (removed at the end)",
        dir.path().display()
    ));

    let (lab, agent, agent_metrics) = start_node(dir.path(), &inventory).await?;
    let cluster = ClusterSide::start(&lab, dir.path()).await?;
    let cx = steps::Context {
        lab: &lab,
        inventory: &inventory,
        client: cluster.client.clone(),
        webhook: cluster.webhook.addr(),
        pki: &cluster.pki,
        queue: cluster.metrics.clone(),
        profile: &opts.profile,
        agent_metrics,
    };
    let results = run_steps(&cx, &mut say).await;

    say.raw("");
    let mut problems = cluster.stop().await;
    problems.extend(teardown(
        "node agent",
        agent.stop().await.map_err(|e| e.to_string()),
    ));
    drop(lab);
    let path = dir.path().to_path_buf();
    problems.extend(teardown(
        "removing the working dir",
        dir.close().map_err(|e| e.to_string()),
    ));
    match problems.is_empty() {
        true => say.say(format!("stopped everything; removed {}", path.display())),
        false => say.say(format!("shut down with problems: {}", problems.join("; "))),
    }
    say.raw("");
    Ok(Summary {
        profile: opts.profile.clone(),
        results,
        elapsed: started.elapsed(),
        shutdown: problems,
    })
}

/// The DeviceClasses `kubectl apply -k daemonset/` installs (gpu, mig and the MIG size
/// families): claims name them, and quota prices a claim by its class.
const DEVICE_CLASSES: &str = include_str!("../../../../daemonset/deviceclasses.yaml");

async fn install_device_classes(client: &kube::Client) -> Result<(), DemoError> {
    let api = Api::<DeviceClass>::all(client.clone());
    for doc in serde_yaml_ng::Deserializer::from_str(DEVICE_CLASSES) {
        let class = DeviceClass::deserialize(doc).map_err(DemoError::DeviceClasses)?;
        let name = class.metadata.name.clone().unwrap_or_default();
        api.create(&PostParams::default(), &class)
            .await
            .map_err(|cause| DemoError::DeviceClass { name, cause })?;
    }
    Ok(())
}

/// The node lab in `dir` with the real agent on `inventory`, registered with both kubelet
/// APIs and followed by the DRA health stream, sampling its devices and serving `/metrics` on
/// the address returned.
async fn start_node(
    dir: &Path,
    inventory: &Inventory,
) -> Result<(NodeLab, RunningAgent, std::net::SocketAddr), DemoError> {
    let mut lab = NodeLab::start(
        dir,
        SimSource::new(inventory.clone()),
        KubeletDraOptions::default(),
    )
    .await?;
    // The node's Node object, as a cluster has it: the agent writes its GPU labels there.
    lab.api
        .put_json(serde_json::json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}
        }))
        .map_err(LabError::from)?;
    lab.telemetry = Some(gpuplane_node::telemetry::TelemetryOptions {
        interval: Duration::from_millis(200),
        host_proc: None,
        idle: None,
    });
    // A loopback port free a moment ago, for the agent's /metrics.
    let metrics = std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| DemoError::AgentStart(format!("finding a port for /metrics: {e}")))?;
    let agent = lab.start_agent_serving(&agent_config(inventory), Some(metrics))?;
    lab.dra
        .wait_registered(DRIVER, START_WAIT)
        .await
        .map_err(DemoError::AgentStart)?;
    lab.kubelet
        .wait_for(START_WAIT, |p| !p.is_empty())
        .await
        .map_err(DemoError::AgentStart)?;
    lab.dra
        .watch_health(DRIVER)
        .map_err(|s| DemoError::AgentStart(s.message().to_string()))?;
    Ok((lab, agent, metrics))
}

/// The cluster side against the lab's API server double: the quotas, the webhook over HTTPS
/// and the controller loops.
struct ClusterSide {
    client: kube::Client,
    pki: DemoPki,
    webhook: RunningWebhook,
    metrics: Arc<QueueMetrics>,
    stop_controller: oneshot::Sender<()>,
    controller: JoinHandle<Result<(), ElectionError>>,
}

impl ClusterSide {
    async fn start(lab: &NodeLab, dir: &Path) -> Result<ClusterSide, DemoError> {
        // The quotas exist before the webhook starts, so its first cache fill has them.
        let client = lab.api.client().map_err(LabError::from)?;
        install_device_classes(&client).await?;
        for (namespace, spec) in quotas().map_err(DemoError::QuotaSpec)? {
            create_quota(&client, namespace, spec).await?;
        }
        // A pod that ran before the controller started: its new GPU-hours book counts it.
        lab.api
            .put_json(steps::hours::finished_pod())
            .map_err(LabError::from)?;
        let pki = DemoPki::issue(dir)?;
        let mut wopts = WebhookOptions::new(
            pki.cert_file.clone(),
            pki.key_file.clone(),
            CONTROLLER_NAMESPACE,
        );
        wopts.addr = ([127, 0, 0, 1], 0).into();
        let webhook = gpuplane_cluster::webhook::start(client.clone(), wopts).await?;

        // One replica: the loops run at once, without a Lease. Short batching and resync so
        // the story does not wait on timers tuned for a large cluster.
        // The GPU-hours book is written every 200 ms with no lag (no kubelet reports late here).
        let mut copts = ControllerOptions::new(CONTROLLER_NAMESPACE, "gpuplane-demo");
        copts.leader_elect = false;
        copts.queue = QueueOptions {
            settings: QueueSettings::default(),
            batch: Duration::from_millis(20),
            resync: Duration::from_millis(500),
            note_refresh: Duration::from_millis(200),
            instance: "gpuplane-demo".into(),
            hours: Some(HoursOptions {
                settings: HoursSettings {
                    lag: Duration::ZERO,
                    ..HoursSettings::default()
                },
                interval: Duration::from_millis(200),
                namespace: CONTROLLER_NAMESPACE.into(),
                prometheus: None,
            }),
            ..QueueOptions::default()
        };
        let metrics = Arc::new(QueueMetrics::default());
        let (stop_controller, controller_stopped) = oneshot::channel::<()>();
        let controller = tokio::spawn(gpuplane_cluster::controller::run(
            client.clone(),
            copts,
            metrics.clone(),
            async {
                let _ = controller_stopped.await;
            },
        ));
        Ok(ClusterSide {
            client,
            pki,
            webhook,
            metrics,
            stop_controller,
            controller,
        })
    }

    /// Stops the controller loops, then the webhook; what went wrong on the way.
    async fn stop(self) -> Vec<String> {
        let _ = self.stop_controller.send(());
        let stopped = match self.controller.await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let problems = teardown("controller", stopped).into_iter().collect();
        self.webhook.stop().await;
        problems
    }
}

/// Every step in order, each under its numbered heading with its outcome.
async fn run_steps(cx: &steps::Context<'_>, say: &mut Narrator<'_>) -> Vec<StepResult> {
    let mut carry = steps::Carry::default();
    let mut results = Vec::new();
    for step in summary::Step::ALL {
        say.raw("");
        say.raw(format!("{}. {}", step.number(), step.title()));
        let outcome = steps::run(step, cx, &mut carry, say).await;
        say.say(format!("=> {}: {}", outcome.word(), outcome.detail()));
        results.push(StepResult { step, outcome });
    }
    results
}

/// A shutdown problem of `what`, if any.
fn teardown(what: &str, r: Result<(), String>) -> Option<String> {
    r.err().map(|e| format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplane_model::config::{AgentConfig, MigStrategy};

    #[test]
    fn the_agent_config_is_valid_and_offers_mig_devices_when_there_are_any() {
        for (profile, strategy) in [
            ("dgx-h100", MigStrategy::None),
            ("a100-mig-mixed", MigStrategy::Mixed),
        ] {
            let inv = gpuplane_model::sim::load(profile).unwrap_or_else(|e| panic!("{e}"));
            let cfg = AgentConfig::parse("demo.yaml", &agent_config(&inv))
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(cfg.mig_strategy, strategy, "{profile}");
            assert_eq!(cfg.recovery_quiet_period, RECOVERY_QUIET_PERIOD);
        }
        // dgx-h100 shares its last GPU; dynamic-mig-mixed shares its L4 and cuts GPUs 0 and 1.
        let h100 = gpuplane_model::sim::load("dgx-h100").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((shared_gpu(&h100), dynamic_gpus(&h100)), (Some(7), vec![]));
        let dynamic =
            gpuplane_model::sim::load("dynamic-mig-mixed").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (shared_gpu(&dynamic), dynamic_gpus(&dynamic)),
            (Some(3), vec![0, 1])
        );
        let text = agent_config(&dynamic);
        AgentConfig::parse("demo.yaml", &text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(quotas().is_ok());
    }
}
