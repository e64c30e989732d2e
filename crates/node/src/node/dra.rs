//! Wires the DRA driver into the agent: the claim-preparing core (with Events on claims for
//! the failures users must see), its kubelet-facing gRPC server, and the ResourceSlice
//! publisher fed from the shared state.

use crate::cdi::hook::install_hook_exe;
use crate::cdi::MemoryLimitHook;
use crate::dra::core::{CoreError, DraCore, DraCoreConfig};
use crate::dra::fetch::KubeClaims;
use crate::dra::server::{DraServer, ServeError};
use crate::inventory::DeviceUuid;
use crate::ledger::dra_view;
use crate::mps::pods::{MpsPods, PodSettings};
use crate::mps::MpsHost;
use crate::node::events::{ClaimEvents, ReportingDriver};
use crate::paths::HostPaths;
use crate::slices::publisher::{keep_published, LoopOptions, SlicePublisher};
use crate::slices::render;
use crate::source::{DeviceMode, DeviceSource};
use crate::state::{NodeState, Snapshot};
use gpuplane_model::report::chain;
use k8s_openapi::api::resource::v1::ResourceSlice;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The DRA driver's settings.
#[derive(Clone)]
pub struct DraSettings {
    /// The driver name (`gpu.gpuplane.dev`; `gpu.nvidia.com` for a drop-in swap).
    pub driver_name: String,
    /// Client for the API server (claims, ResourceSlices, Events on claims).
    pub client: kube::Client,
    /// Set when MPS control daemons run in pods of their own; `None`: as the agent's
    /// processes.
    pub mps_pods: Option<PodSettings>,
}

#[derive(Debug, thiserror::Error)]
pub enum DraStartError {
    #[error("starting the DRA driver: {}", chain(.0))]
    Core(CoreError),
    #[error("starting the DRA driver's sockets: {}", chain(.0))]
    Serve(ServeError),
    #[error("starting the DRA driver: {}", chain(.0))]
    MpsPods(crate::mps::pods::PodsError),
    #[error("starting the DRA driver: its start-up job did not finish: {0}")]
    Worker(String),
}

/// The slices this node should publish now: the DRA view of the inventory with health taints
/// and its shared units as shared devices, plus an in-use taint on devices the device plugin
/// API holds.
pub fn desired_slices(s: &Snapshot, driver: &str, node: &str) -> Vec<ResourceSlice> {
    let inv = dra_view(&s.inventory, &s.config.allocation);
    let shared = crate::sharing::shared_units(&inv, s.config.shares.as_ref());
    let mut slices = render::render_with_generation(&inv, &s.health, driver, node, 0, &shared);
    let blocked = s.ledger.device_plugin_blocked();
    if blocked.is_empty() {
        return slices;
    }
    for device in slices
        .iter_mut()
        .flat_map(|sl| sl.spec.devices.iter_mut().flatten())
    {
        if inv
            .dra_device(&device.name)
            .is_some_and(|d| blocked.contains(d.uuid().as_str()))
        {
            device
                .taints
                .get_or_insert_with(Vec::new)
                .push(render::in_use_taint());
        }
    }
    slices
}

/// The running DRA driver.
pub struct DraStarted {
    pub tasks: Vec<JoinHandle<()>>,
    /// True once the kubelet confirmed the plugin's registration.
    pub registered: watch::Receiver<bool>,
    /// True while the node's ResourceSlices are published as wanted.
    pub published: watch::Receiver<bool>,
}

/// Starts the DRA core, server and slice publisher; the tasks end when `stop` turns true.
pub async fn start(
    settings: DraSettings,
    node_name: &str,
    paths: &HostPaths,
    device_mode: DeviceMode,
    (state, source): (Arc<NodeState>, Arc<dyn DeviceSource>),
    stop: watch::Receiver<bool>,
) -> Result<DraStarted, DraStartError> {
    let driver = settings.driver_name.clone();
    let mps = match &settings.mps_pods {
        Some(pods) => {
            let real = (device_mode == DeviceMode::Hardware).then(|| source.clone());
            let pods = MpsPods::new(settings.client.clone(), node_name, pods, paths, real)
                .await
                .map_err(DraStartError::MpsPods)?;
            Some(Arc::new(pods) as Arc<dyn MpsHost>)
        }
        None => None,
    };
    let mut config = DraCoreConfig {
        paths: paths.clone(),
        device_mode,
        mps,
        ..DraCoreConfig::new(&driver, node_name)
    };
    let claims = Arc::new(KubeClaims::new(settings.client.clone()));
    let core_state = state.clone();
    // Installing the hook's executable, loading the checkpoint and restoring claim specs read
    // and write files: off the runtime.
    let core = tokio::task::spawn_blocking(move || {
        if device_mode == DeviceMode::Hardware {
            config.memory_limits = memory_limit_hook(&config.paths, source.as_ref());
        }
        DraCore::new(config, core_state, claims, source)
    })
    .await
    .map_err(|e| DraStartError::Worker(e.to_string()))?
    .map_err(DraStartError::Core)?;
    core.restore_holds().await;
    let events = ClaimEvents::new(
        settings.client.clone(),
        &driver,
        node_name,
        state.counters().clone(),
    );
    let reporting = ReportingDriver::new(core, events);
    let server = DraServer::new(&paths.kubelet_root, &driver, Arc::new(reporting))
        .map_err(DraStartError::Serve)?;
    let registered = server.registered();
    let mut tasks = Vec::new();
    let server_stop = stop.clone();
    tasks.push(tokio::spawn(async move {
        if let Err(e) = server.run(server_stop).await {
            tracing::error!(error = %e, "DRA server stopped");
        }
    }));

    let publisher = SlicePublisher::new(settings.client, driver.clone(), node_name);
    let published = publisher.published();
    tasks.push(tokio::spawn(publish(
        publisher,
        state,
        driver,
        node_name.to_string(),
        stop,
    )));
    Ok(DraStarted {
        tasks,
        registered,
        published,
    })
}

/// Keeps this node's slices equal to [`desired_slices`] of the state, from the moment the
/// device plugin's holds are known until `stop`. Before that, a slice written would lack the
/// in-use taints the previous agent published, and the scheduler would hand those GPUs to
/// claims: the slices on the API server stay as they are. The first desired value is computed
/// only then, so the first sync already carries every hold (and, unchanged, writes nothing).
async fn publish(
    publisher: SlicePublisher,
    state: Arc<NodeState>,
    driver: String,
    node: String,
    mut stop: watch::Receiver<bool>,
) {
    if state.read().awaiting_device_plugin_holds {
        tracing::info!(
            "ResourceSlices wait for the first PodResources listing (the device plugin's holds)"
        );
    }
    tokio::select! {
        _ = state.device_plugin_holds_known(None) => {}
        _ = stop.wait_for(|s| *s) => return,
    }
    // Subscribed before the first value is computed: no change falls in between.
    let mut changes = state.subscribe_holds();
    let mut rendered_from = slice_inputs(&state);
    let (tx, rx) = watch::channel(desired_slices(&state.read(), &driver, &node));
    let mut follow_stop = stop.clone();
    // Desired slices follow every state change; the publisher writes only differences.
    let follow = async move {
        loop {
            tokio::select! {
                r = changes.changed() => if r.is_err() { return },
                _ = follow_stop.wait_for(|s| *s) => return,
            }
            // Most changes are DRA claims' holds, which slices do not show: render only when
            // the node or the device plugin's holds changed.
            let inputs = slice_inputs(&state);
            if inputs == rendered_from {
                continue;
            }
            rendered_from = inputs;
            let next = desired_slices(&state.read(), &driver, &node);
            tx.send_if_modified(|cur| {
                let differs = *cur != next;
                if differs {
                    *cur = next;
                }
                differs
            });
        }
    };
    let options = LoopOptions {
        resync: Duration::from_secs(300),
        retry: Duration::from_secs(1),
        watch: true,
    };
    let keep = keep_published(publisher, rx, options, async move {
        let _ = stop.wait_for(|s| *s).await;
    });
    tokio::join!(follow, keep);
}

/// What [`desired_slices`] depends on, in brief: the node's generation and the units the device
/// plugin holds. The generation is read first, so a node change between the two reads renders
/// again at its own wake-up.
fn slice_inputs(state: &NodeState) -> (u64, BTreeSet<DeviceUuid>) {
    let generation = state.node_generation();
    (generation, state.read().ledger.device_plugin_blocked())
}

/// What a share's memory-limit hook runs on this node, where the driver limits GPU memory per
/// cgroup and the node runs cgroup v2: this executable, installed under the state directory,
/// and the NVML library as the host names it. `None` (share memory cooperative, as the claims'
/// status says) otherwise, or when the install fails (logged).
fn memory_limit_hook(paths: &HostPaths, source: &dyn DeviceSource) -> Option<MemoryLimitHook> {
    let lib = source.memory_limit_library()?;
    if !std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        tracing::warn!("the driver limits GPU memory per cgroup, but this node does not run cgroup v2: share memory limits stay cooperative");
        return None;
    }
    let installed = std::env::current_exe()
        .map_err(|e| e.to_string())
        .and_then(|exe| install_hook_exe(&exe, &paths.state_dir).map_err(|e| e.to_string()));
    match installed {
        Ok(exe) => Some(MemoryLimitHook {
            exe: exe.display().to_string(),
            nvml_lib: host_path(paths, &lib).display().to_string(),
        }),
        Err(e) => {
            tracing::error!(error = %e, "cannot install the executable of the memory-limit CDI hook: share memory limits stay cooperative");
            None
        }
    }
}

/// `path` as the host names it: under the driver root when the agent reads that root at
/// another mount.
fn host_path(paths: &HostPaths, path: &std::path::Path) -> std::path::PathBuf {
    match paths
        .driver_root_mount
        .as_deref()
        .and_then(|m| path.strip_prefix(m).ok())
    {
        Some(rest) => paths.driver_root.join(rest),
        None => path.to_path_buf(),
    }
}
