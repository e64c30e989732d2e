//! A node without a cluster: the real agent (`gpuplane_node::node::run`) on a simulated machine, wired
//! to the API server double over HTTP (real kube client) and to the kubelet doubles (device
//! plugin and DRA) over unix sockets, every path under one directory the caller owns.
//! `gpuplane demo` and the end-to-end tests share this wiring, so both exercise the same set-up.
//! By default the agent runs as `gpuplane node --simulate` does ([`DeviceMode::Simulated`]):
//! no device nodes or driver files, CDI specs that carry each device's identity in the
//! environment.

use super::apiserver::{ApiServerDouble, ApiServerError};
use super::kubelet::KubeletDouble;
use super::kubelet_dra::{KubeletDraDouble, KubeletDraOptions, WireClaim};
use super::stall::StallingSim;
use gpuplane_model::report::chain;
use gpuplane_model::source::{DeviceMode, DeviceSource, SimSource, SourceError};
use gpuplane_node::dra::{ClaimRef, PreparedDevice};
use gpuplane_node::grpc::SocketError;
use gpuplane_node::node::apis::{self, Apis};
use gpuplane_node::node::dra::DraSettings;
use gpuplane_node::node::{NodeError, NodeOptions};
use gpuplane_node::paths::HostPaths;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The node's name, which is also the pool name of its devices.
pub const NODE: &str = "node-a";
/// The DRA driver name the lab's agent serves.
pub const DRIVER: &str = gpuplane_model::quota::catalog::DEFAULT_DRIVER;
/// The device class the lab's claims name.
pub const DEVICE_CLASS: &str = "gpu.gpuplane.dev";

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("lab: {what} {}: {}", path.display(), chain(.cause))]
    Io {
        what: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("lab: {}", chain(.0))]
    ApiServer(ApiServerError),
    #[error("lab: kubelet double: {}", chain(.0))]
    Socket(SocketError),
    #[error("lab: the simulated machine: {}", chain(.0))]
    Source(SourceError),
    #[error("lab: the stored ResourceClaim {0} has no usable uid")]
    ClaimUid(String),
    #[error("lab: the agent failed: {}", chain(.0))]
    Agent(NodeError),
    #[error("lab: {}", chain(.0))]
    DraPaths(gpuplane_node::dra::server::ServeError),
    #[error("lab: the agent's task ended abnormally: {}", chain(.0))]
    AgentTask(tokio::task::JoinError),
}

gpuplane_model::causes_from!(LabError {
    ApiServer(ApiServerError),
    Socket(SocketError),
    Source(SourceError),
    Agent(NodeError),
    DraPaths(gpuplane_node::dra::server::ServeError),
    AgentTask(tokio::task::JoinError),
});

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> LabError {
    let path = path.to_path_buf();
    move |source| LabError::Io {
        what,
        path,
        cause: source,
    }
}

/// The doubles and the simulated machine; the agent is started with [`NodeLab::start_agent`].
pub struct NodeLab {
    root: PathBuf,
    pub api: ApiServerDouble,
    pub kubelet: KubeletDouble,
    pub dra: KubeletDraDouble,
    /// Clones share state with the agent's source: inject Xids, lose GPUs or stall NVML
    /// calls through it.
    pub sim: StallingSim,
    /// How agents started from now on treat their devices; `Simulated` unless a caller that
    /// made device nodes under `dev/` (see `devnodes`) sets `Hardware`.
    pub device_mode: DeviceMode,
    /// The agent's own pod, for agents started from now on to run MPS daemons in pods
    /// (`--mps-daemons=pods`; run them with `pod_runner`); `None`: as the agent's processes.
    pub mps_pods: Option<gpuplane_node::mps::pods::PodSettings>,
    /// Device telemetry for agents started from now on; `None` samples nothing.
    pub telemetry: Option<gpuplane_node::telemetry::TelemetryOptions>,
}

/// A running agent of a lab.
pub struct RunningAgent {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), NodeError>>,
}

impl RunningAgent {
    /// Asks the agent to shut down (as SIGTERM does) and waits for it.
    pub async fn stop(mut self) -> Result<(), LabError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await??;
        Ok(())
    }

    /// Whether the agent's task has ended already (it failed, or was stopped).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        // Dropped without `stop` (a failed run): do not leave the agent serving.
        self.task.abort();
    }
}

impl NodeLab {
    /// Starts the API server double and both kubelet doubles under `root` (which must exist),
    /// for the machine `sim` simulates.
    pub async fn start(
        root: &Path,
        sim: SimSource,
        kubelet: KubeletDraOptions,
    ) -> Result<NodeLab, LabError> {
        let kubelet_root = root.join("kubelet");
        let api = ApiServerDouble::start().await?;
        let dp = KubeletDouble::start(&kubelet_root).await?;
        let dra = KubeletDraDouble::start(&kubelet_root, kubelet);
        Ok(NodeLab {
            root: root.to_path_buf(),
            api,
            kubelet: dp,
            dra,
            sim: StallingSim::new(sim),
            device_mode: DeviceMode::Simulated,
            mps_pods: None,
            telemetry: None,
        })
    }

    /// The directory everything lives under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The agent's paths, all under the lab's directory.
    pub fn paths(&self) -> HostPaths {
        HostPaths {
            // The host's: device-node tests compare with the numbers its drivers registered.
            proc_root: HostPaths::standard().proc_root,
            ..HostPaths::under(&self.root)
        }
    }

    /// The agent's DRA sockets (registration and DRA) for [`DRIVER`].
    pub fn dra_sockets(&self) -> Result<gpuplane_node::dra::server::DraPaths, LabError> {
        Ok(gpuplane_node::dra::server::DraPaths::new(
            &self.paths().kubelet_root,
            DRIVER,
        )?)
    }

    /// The agent's device plugin socket for `resource`.
    pub fn device_plugin_socket(&self, resource: &str) -> PathBuf {
        self.paths()
            .device_plugins()
            .join(gpuplane_node::deviceplugin::registrar::socket_name(
                resource,
            ))
    }

    /// Writes `config` (the agent's YAML config) to `config.yaml` and starts the agent with the
    /// device plugin and DRA on, in the background.
    pub fn start_agent(&self, config: &str) -> Result<RunningAgent, LabError> {
        self.start_agent_serving(config, None)
    }

    /// [`NodeLab::start_agent`], also serving `/metrics`, `/healthz` and `/readyz` on `metrics`.
    pub fn start_agent_serving(
        &self,
        config: &str,
        metrics_addr: Option<std::net::SocketAddr>,
    ) -> Result<RunningAgent, LabError> {
        self.start_agent_with_client(config, metrics_addr, self.api.client()?)
    }

    /// [`NodeLab::start_agent_serving`] with `client` as the agent's kube client (one with a
    /// short read timeout, say) instead of the double's default one.
    pub fn start_agent_with_client(
        &self,
        config: &str,
        metrics_addr: Option<std::net::SocketAddr>,
        client: kube::Client,
    ) -> Result<RunningAgent, LabError> {
        let cfg = self.root.join("config.yaml");
        std::fs::write(&cfg, config).map_err(io("writing", &cfg))?;
        let (paths, device_mode, mps_pods) =
            (self.paths(), self.device_mode, self.mps_pods.clone());
        let telemetry = self.telemetry.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let source: Arc<dyn DeviceSource> = Arc::new(self.sim.clone());
        // Both APIs, unless the Node object in the double carries the APIs label (as
        // `gpuplane node` with --device-plugin=true --dra=true).
        let task = tokio::spawn(async move {
            let both = Apis {
                device_plugin: true,
                dra: true,
            };
            let serving = apis::resolve(&client, NODE, both).await?;
            let opts = NodeOptions {
                node_name: NODE.into(),
                paths,
                config_file: Some(cfg),
                sharing_switch: serving.sharing,
                device_plugin: serving.apis.device_plugin,
                dra: serving.apis.dra.then(|| DraSettings {
                    driver_name: DRIVER.into(),
                    client: client.clone(),
                    mps_pods,
                }),
                api: Some(client.clone()),
                metrics_addr,
                device_mode,
                telemetry,
            };
            gpuplane_node::node::run(opts, source, async move {
                tokio::select! {
                    _ = stopped => {}
                    _ = apis::changed(client, NODE.into(), both, serving) => {}
                }
            })
            .await
        });
        Ok(RunningAgent {
            stop: Some(stop),
            task,
        })
    }

    /// The published ResourceSlices, straight from the double's store.
    pub fn slices(&self) -> Vec<Value> {
        self.api
            .list_json("resource.k8s.io/v1", "resourceslices", None)
    }

    /// The taints of a published device, as `key=value`.
    pub fn taints(&self, device: &str) -> Vec<String> {
        let mut out = Vec::new();
        for s in &self.slices() {
            for d in s["spec"]["devices"].as_array().into_iter().flatten() {
                if d["name"] == device {
                    for t in d["taints"].as_array().into_iter().flatten() {
                        out.push(format!(
                            "{}={}",
                            t["key"].as_str().unwrap_or(""),
                            t["value"].as_str().unwrap_or("")
                        ));
                    }
                }
            }
        }
        out
    }

    /// Stores a claim in `namespace` as the scheduler leaves it: allocated to `devices` of this
    /// node's pool, one request `gpus` of class [`DEVICE_CLASS`].
    pub fn claim(
        &self,
        namespace: &str,
        name: &str,
        devices: &[&str],
    ) -> Result<ClaimRef, LabError> {
        let results: Vec<Value> = devices
            .iter()
            .map(|d| json!({"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d}))
            .collect();
        self.store_claim(namespace, name, results, json!({"count": devices.len()}))
    }

    /// Stores a claim allocated a share of the shared `device` (consumable capacity): the
    /// result's `shareID` and `consumedCapacity` as the scheduler writes them.
    pub fn share_claim(
        &self,
        namespace: &str,
        name: &str,
        device: &str,
        memory: &str,
        compute: u32,
    ) -> Result<ClaimRef, LabError> {
        let result = json!({"request": "gpus", "driver": DRIVER, "pool": NODE, "device": device,
            "shareID": format!("{name}-share"),
            "consumedCapacity": {"memory": memory, "compute": compute.to_string()}});
        let capacity =
            json!({"capacity": {"requests": {"memory": memory, "compute": compute.to_string()}}});
        self.store_claim(namespace, name, vec![result], capacity)
    }

    /// Stores an allocated claim of one request `gpus` of class [`DEVICE_CLASS`] (with the
    /// request's further fields `exactly`) and returns its reference.
    fn store_claim(
        &self,
        namespace: &str,
        name: &str,
        results: Vec<Value>,
        exactly: Value,
    ) -> Result<ClaimRef, LabError> {
        let mut request = json!({"deviceClassName": DEVICE_CLASS});
        if let (Some(r), Some(extra)) = (request.as_object_mut(), exactly.as_object()) {
            r.extend(extra.clone());
        }
        let obj = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": request}]}},
            "status": {"allocation": {"devices": {"results": results}}}
        });
        let stored = self.api.put_json(obj)?;
        let uid = stored["metadata"]["uid"]
            .as_str()
            .ok_or_else(|| LabError::ClaimUid(format!("{namespace}/{name}")))?;
        ClaimRef::parse(namespace, uid, name)
            .map_err(|e| LabError::ClaimUid(format!("{namespace}/{name} ({e})")))
    }

    /// NodePrepareResources for one claim through the DRA kubelet double: the prepared devices,
    /// or the error the kubelet would see (a refusal, or the call failing).
    pub async fn prepare<C: WireClaim>(&self, claim: &C) -> Result<Vec<PreparedDevice>, String> {
        let mut out = self
            .dra
            .prepare(DRIVER, std::slice::from_ref(claim))
            .await
            .map_err(|s| s.message().to_string())?;
        out.remove(claim.uid())
            .unwrap_or_else(|| Err(format!("no answer for claim {}", claim.uid())))
    }

    /// NodeUnprepareResources for one claim through the DRA kubelet double.
    pub async fn unprepare<C: WireClaim>(&self, claim: &C) -> Result<(), String> {
        let mut out = self
            .dra
            .unprepare(DRIVER, std::slice::from_ref(claim))
            .await
            .map_err(|s| s.message().to_string())?;
        out.remove(claim.uid())
            .unwrap_or_else(|| Err(format!("no answer for claim {}", claim.uid())))
    }
}
