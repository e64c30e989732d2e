//! MPS control daemons in pods of their own (`--mps-daemons=pods`, the DaemonSet's choice):
//! one pod per shared unit, rendered by [`gpuplane_model::mps_pod`] from what the agent's own
//! pod says (image, pull policy and secrets, tolerations, priority class, DaemonSet), named
//! after the node and unit so a restarted agent finds it again, deleted once the unit's last
//! share is unprepared. The pod serves when its `ready.lock` is held ([`super::daemon::serving`]);
//! the agent reads that from the unit's directory rather than from the API, because the lock
//! is released the instant the daemon stops, however it stops.

use super::daemon::{instance_runs, serving};
use super::{compute_mode, executable, DaemonDirs, MpsError, MpsHost, PROGRAM};
use crate::inventory::DeviceUuid;
use crate::paths::HostPaths;
use crate::source::DeviceSource;
use gpuplane_model::mps_pod::{self, AgentPod, DaemonPod};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How long a prepare waits for a new daemon pod to serve: the image is the agent's, already
/// on the node, so this covers a container start on a busy node, inside the kubelet's own
/// NodePrepareResources deadline.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an unprepare waits for a deleted daemon pod's instance to end: the pod's grace
/// period (30 s) and a margin.
const STOP_TIMEOUT: Duration = Duration::from_secs(40);
/// How often the unit's locks are read while waiting (a lock probe is two system calls); the
/// API is read every [`API_EVERY`]th time.
const POLL: Duration = Duration::from_millis(20);
const API_EVERY: u64 = 50;

/// What `--mps-daemons=pods` needs to know.
#[derive(Debug, Clone)]
pub struct PodSettings {
    /// The agent's own pod (the downward API's metadata.namespace and metadata.name).
    pub namespace: String,
    pub name: String,
    /// The agent's libnvidia-ml when its devices are real: daemon pods set their GPU's compute
    /// mode through it.
    pub nvml_lib: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum PodsError {
    #[error("reading the agent's own pod {namespace}/{name}: {cause}")]
    Read {
        namespace: String,
        name: String,
        cause: String,
    },
}

/// The MPS daemon pods of this node.
#[derive(Clone)]
pub struct MpsPods {
    api: Api<Pod>,
    runtime: tokio::runtime::Handle,
    node: String,
    agent: AgentPod,
    paths: HostPaths,
    nvml_lib: Option<PathBuf>,
    /// The agent's devices, to put a GPU's compute mode back where its daemon pod could not.
    source: Option<Arc<dyn DeviceSource>>,
}

impl std::fmt::Debug for MpsPods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpsPods")
            .field("node", &self.node)
            .field("namespace", &self.agent.namespace)
            .field("image", &self.agent.image)
            .finish()
    }
}

impl MpsPods {
    /// Reads the agent's own pod for what daemon pods copy from it. `source`: the agent's
    /// real devices (none when simulated).
    pub async fn new(
        client: kube::Client,
        node: &str,
        settings: &PodSettings,
        paths: &HostPaths,
        source: Option<Arc<dyn DeviceSource>>,
    ) -> Result<MpsPods, PodsError> {
        let (namespace, name) = (settings.namespace.as_str(), settings.name.as_str());
        let read = |cause: String| PodsError::Read {
            namespace: namespace.to_string(),
            name: name.to_string(),
            cause,
        };
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let me = api.get(name).await.map_err(|e| read(e.to_string()))?;
        let mut agent = AgentPod::from_pod(&me, None).map_err(read)?;
        agent.namespace = namespace.to_string();
        info!(namespace, image = %agent.image, "MPS control daemons run in pods of their own");
        Ok(MpsPods {
            api,
            runtime: tokio::runtime::Handle::current(),
            node: node.to_string(),
            agent,
            paths: paths.clone(),
            nvml_lib: settings.nvml_lib.clone(),
            source,
        })
    }

    fn pod(&self, unit: &str, multiuser: bool) -> Pod {
        let state_dir = self.paths.state_dir.to_string_lossy();
        let driver_root = self.paths.driver_root.to_string_lossy();
        let mount = self.paths.driver_files();
        let nvml_lib = self.nvml_lib.as_ref().map(|l| l.to_string_lossy());
        DaemonPod {
            node: &self.node,
            unit,
            multiuser,
            agent: &self.agent,
            state_dir: &state_dir,
            driver_root: &driver_root,
            driver_root_mount: &mount.to_string_lossy(),
            nvml_lib: nvml_lib.as_deref(),
        }
        .render()
    }

    fn get(&self, name: &str) -> Result<Option<Pod>, String> {
        self.runtime
            .block_on(self.api.get_opt(name))
            .map_err(|e| format!("reading pod {}/{name}: {e}", self.agent.namespace))
    }

    fn create(&self, unit: &str, multiuser: bool) -> Result<(), String> {
        match self.runtime.block_on(
            self.api
                .create(&PostParams::default(), &self.pod(unit, multiuser)),
        ) {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(format!(
                "creating pod {}/{}: {e}",
                self.agent.namespace,
                mps_pod::pod_name(&self.node, unit)
            )),
        }
    }

    fn delete(&self, name: &str) -> Result<(), String> {
        match self
            .runtime
            .block_on(self.api.delete(name, &DeleteParams::default()))
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(format!("deleting pod {}/{name}: {e}", self.agent.namespace)),
        }
    }

    /// This node's daemon pods, by unit.
    fn listed(&self) -> Result<BTreeMap<String, String>, String> {
        let params = ListParams::default()
            .labels(&format!("app.kubernetes.io/name={}", mps_pod::APP))
            .fields(&format!("spec.nodeName={}", self.node));
        let pods = self
            .runtime
            .block_on(self.api.list(&params))
            .map_err(|e| format!("listing MPS daemon pods: {e}"))?;
        Ok(pods
            .items
            .into_iter()
            .filter_map(|p| {
                let unit = p.metadata.annotations?.remove(mps_pod::UNIT_ANNOTATION)?;
                Some((unit, p.metadata.name?))
            })
            .collect())
    }
}

/// Why a pod does not serve yet, as `kubectl get pod` would say it.
fn describe(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let container = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref());
    let detail = container.and_then(|s| {
        if let Some(w) = &s.waiting {
            return Some(format!(
                "{}: {}",
                w.reason.as_deref().unwrap_or("waiting"),
                w.message.as_deref().unwrap_or("")
            ));
        }
        s.terminated.as_ref().map(|t| {
            format!(
                "exited {}: {}",
                t.exit_code,
                t.message.as_deref().unwrap_or("")
            )
        })
    });
    match detail {
        Some(d) => format!("{phase}, {}", d.trim_end_matches([' ', ':'])),
        None => phase.to_string(),
    }
}

impl MpsHost for MpsPods {
    fn available(&self) -> bool {
        executable(&self.paths.driver_files().join(PROGRAM))
    }

    fn dirs(&self, unit: &str) -> DaemonDirs {
        DaemonDirs::new(&self.paths.state_dir, unit)
    }

    fn shares_shm(&self) -> bool {
        true
    }

    fn ensure(&self, unit: &str, multiuser: bool) -> Result<bool, MpsError> {
        let dirs = self.dirs(unit);
        if serving(&dirs) {
            return Ok(false);
        }
        let name = mps_pod::pod_name(&self.node, unit);
        let fail = |cause: String| MpsError::Start {
            unit: unit.to_string(),
            cause,
            log: format!("kubectl -n {} logs {name}", self.agent.namespace),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        let mut state = "not created".to_string();
        let mut round = 0u64;
        loop {
            if serving(&dirs) {
                info!(unit, pod = %name, "the MPS control daemon's pod serves");
                return Ok(true);
            }
            if round.is_multiple_of(API_EVERY) {
                match self.get(&name).map_err(fail)? {
                    None => {
                        self.create(unit, multiuser).map_err(fail)?;
                        state = "created".into();
                    }
                    // The pod of an earlier stop still ends; its successor follows.
                    Some(p) if p.metadata.deletion_timestamp.is_some() => {
                        state = "an earlier pod of this name is still being deleted".into()
                    }
                    Some(p) => state = describe(&p),
                }
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "its pod {}/{name} did not serve within {START_TIMEOUT:?} ({state})",
                    self.agent.namespace
                )));
            }
            std::thread::sleep(POLL);
            round += 1;
        }
    }

    fn stop(&self, unit: &str) -> Result<(), MpsError> {
        let dirs = self.dirs(unit);
        let name = mps_pod::pod_name(&self.node, unit);
        let fail = |cause: String| MpsError::Stop {
            unit: unit.to_string(),
            cause,
            log: format!("kubectl -n {} logs {name}", self.agent.namespace),
        };
        self.delete(&name).map_err(fail)?;
        let deadline = Instant::now() + STOP_TIMEOUT;
        while instance_runs(&dirs) {
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "its pod {}/{name} was deleted but its daemon still ran after {STOP_TIMEOUT:?}",
                    self.agent.namespace
                )));
            }
            std::thread::sleep(POLL);
        }
        info!(unit, pod = %name, "stopped the MPS control daemon's pod");
        // A pod killed before it put the compute mode back left its record.
        if let Some(source) = &self.source {
            if compute_mode::restore(source.as_ref(), &dirs.root)
                .map_err(|e| fail(e.to_string()))?
            {
                info!(unit, "put back the compute mode its daemon pod left");
            }
        }
        match std::fs::remove_dir_all(&dirs.root) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(fail(format!("removing its directories: {e}"))),
        }
    }

    fn reconcile(&self, wanted: &BTreeMap<DeviceUuid, bool>) {
        let listed = match self.listed() {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "the MPS daemon pods are not known; each is started again by the next prepare of its GPU");
                return;
            }
        };
        for unit in listed.keys() {
            if !wanted.keys().any(|w| w.as_str() == unit) {
                info!(unit = %unit, "an MPS daemon pod serves no prepared share; deleting it");
                if let Err(e) = self.stop(unit) {
                    warn!(error = %e, "stopping an unneeded MPS daemon pod failed");
                }
            }
        }
        for (unit, multiuser) in wanted {
            if let Some(name) = listed.get(unit.as_str()) {
                info!(unit = %unit, pod = %name, "adopted the running MPS daemon pod");
                continue;
            }
            info!(unit = %unit, "a prepared share had no MPS daemon pod; creating one");
            if let Err(e) = self.create(unit, *multiuser) {
                warn!(error = %e, "creating the MPS daemon pod of prepared shares failed");
            }
        }
    }
}
