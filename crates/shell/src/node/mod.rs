//! `gpuplane node`: the agent's main loop. Wires the device source, the shared state, health
//! and the kubelet-facing servers together; owns start-up, reloads and shutdown.
//!
//! Everything it starts takes its paths and a shutdown signal as arguments, so tests run the
//! real agent in-process against doubles in a temp dir.

pub mod apis;
pub mod cdi;
pub mod deferred;
pub mod dra;
pub mod events;
pub mod http;
pub mod labeler;
pub mod lock;
pub mod podresources;
pub mod probe;
pub mod state;

use crate::config::{AgentConfig, ConfigError};
use crate::deviceplugin::registrar;
use crate::deviceplugin::resources::PlanError;
use crate::health::{Cause, Change, Health};
use crate::inventory::Inventory;
use crate::source::{DeviceMode, DeviceSource, Discovery};
use gpuplane_model::report::chain;
use state::{NodeState, Snapshot};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::watch;

/// Host paths the agent uses, each under its own name.
#[derive(Debug, Clone)]
pub struct NodePaths {
    /// The kubelet's root (`/var/lib/kubelet`): device-plugins/, plugins_registry/, pod-resources/.
    pub kubelet_root: PathBuf,
    /// Where CDI specs are written (`/var/run/cdi`).
    pub cdi_root: PathBuf,
    /// The agent's own durable state (`/var/lib/gpuplane`); one agent at a time (see [`lock`]).
    pub state_dir: PathBuf,
    /// Root of the NVIDIA driver's user-space files as the host sees them (`/` or
    /// `/run/nvidia/driver`): CDI specs name files under it.
    pub driver_root: PathBuf,
    /// Where the agent itself finds `driver_root` when it is mounted elsewhere in its
    /// container (a host-installed driver: the host's `/` at `/host`); `None`: at `driver_root`.
    pub driver_root_mount: Option<PathBuf>,
    /// Where device nodes live (`/dev`).
    pub dev_root: PathBuf,
}

impl NodePaths {
    pub fn device_plugins(&self) -> PathBuf {
        self.kubelet_root.join("device-plugins")
    }

    pub fn pod_resources_socket(&self) -> PathBuf {
        self.kubelet_root.join("pod-resources").join("kubelet.sock")
    }
}

#[derive(Clone)]
pub struct NodeOptions {
    pub node_name: String,
    pub paths: NodePaths,
    /// The agent config file; reloaded on SIGHUP and when it changes.
    pub config_file: Option<PathBuf>,
    /// Serve the kubelet device plugin API.
    pub device_plugin: bool,
    /// Serve DRA (with API access), or not.
    pub dra: Option<dra::DraSettings>,
    /// API access for the node's GPU labels (`nodeLabels` in the config); none: no labels.
    pub api: Option<kube::Client>,
    /// Where to serve /metrics, /healthz and /readyz; `None` serves none.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Real GPUs (device nodes and driver files go into CDI specs) or simulated ones (their
    /// identity goes into the container's environment instead).
    pub device_mode: DeviceMode,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The node's APIs label has a value the agent does not know.
    #[error(transparent)]
    Apis(#[from] apis::ApisError),
    /// Another agent uses the state directory, or it cannot be locked.
    #[error(transparent)]
    Lock(#[from] lock::LockError),
    /// The config file is unusable at start-up.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The devices cannot be offered as configured.
    #[error("cannot offer this node's devices: {}", chain(.0))]
    Plan(PlanError),
    /// The DRA driver could not start.
    #[error(transparent)]
    Dra(#[from] dra::DraStartError),
    /// The metrics address could not be bound.
    #[error("binding the metrics address {addr}: {}", chain(.cause))]
    Metrics {
        addr: std::net::SocketAddr,
        cause: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("installing signal handlers: {}", chain(.0))]
    Signals(std::io::Error),
    /// The thread that probes lost GPUs could not be started.
    #[error("starting the device probe thread: {}", chain(.0))]
    ProbeThread(std::io::Error),
}

fn load_config(path: Option<&Path>) -> Result<AgentConfig, ConfigError> {
    match path {
        Some(p) => AgentConfig::load(p),
        None => Ok(AgentConfig::default()),
    }
}

fn mtime(path: Option<&Path>) -> Option<SystemTime> {
    path.and_then(|p| std::fs::metadata(p).ok())
        .and_then(|m| m.modified().ok())
}

/// The inventory to serve: what answered, plus GPUs known from before that are now lost (so they
/// stay listed, as Unhealthy, instead of silently vanishing).
fn with_lost(previous: Option<&Inventory>, found: &Discovery) -> (Inventory, Vec<String>) {
    let mut inv = found.inventory.clone();
    let mut lost_uuids = Vec::new();
    if let Some(prev) = previous {
        for lost in &found.lost {
            if let Some(g) = prev.gpu(lost.index) {
                if inv.gpu(lost.index).is_none() {
                    inv.gpus.push(g.clone());
                    inv.topology.links.extend(
                        prev.topology
                            .links
                            .iter()
                            .filter(|l| l.from == lost.index || l.to == lost.index)
                            .copied(),
                    );
                }
                lost_uuids.push(g.uuid.clone());
            }
        }
    }
    inv.gpus.sort_by_key(|g| g.index);
    inv.topology.links.sort_by_key(|l| (l.from, l.to));
    inv.topology.links.dedup_by_key(|l| (l.from, l.to));
    (inv, lost_uuids)
}

/// Start-up discovery failures (NVML not loadable yet, a query every GPU needs failing).
const DISCOVERY_FAILURES: &str = "gpuplane_discovery_failures_total";
const DISCOVERY_FAILURES_HELP: &str =
    "Start-up device discovery attempts that failed (each is retried with backoff).";
/// First pause after a failed start-up discovery; it doubles up to [`DISCOVERY_RETRY_MAX`].
const DISCOVERY_RETRY_FIRST: Duration = Duration::from_millis(500);
const DISCOVERY_RETRY_MAX: Duration = Duration::from_secs(30);

/// Discovers until it works, backing off. Each failure is logged, counted and shown by
/// `/readyz`; the readiness tick keeps turning meanwhile, so `/healthz` does not get a pod
/// restarted that is only waiting for its driver (a crash loop would not bring it sooner).
async fn discover_with_retry(
    source: &Arc<dyn DeviceSource>,
    readiness: &http::Readiness,
) -> Discovery {
    let mut delay = DISCOVERY_RETRY_FIRST;
    let mut failures = 0u64;
    loop {
        let s = source.clone();
        let why = match tokio::task::spawn_blocking(move || s.discover()).await {
            Ok(Ok(d)) => {
                *readiness
                    .discovery
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = None;
                return d;
            }
            Ok(Err(e)) => e.to_string(),
            Err(e) => format!("discovery panicked: {e}"),
        };
        failures += 1;
        crate::metrics::global().inc(DISCOVERY_FAILURES, DISCOVERY_FAILURES_HELP, &[]);
        tracing::error!(error = %why, attempt = failures, retry_in = ?delay, "device discovery failed; retrying");
        *readiness
            .discovery
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(format!(
            "{failures} attempt(s) failed, retrying in {delay:?}: {why}"
        ));
        let until = Instant::now() + delay;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            readiness.tick();
            tokio::time::sleep(left.min(Duration::from_millis(250))).await;
        }
        delay = (delay * 2).min(DISCOVERY_RETRY_MAX);
    }
}

/// Removes temporary files a killed agent left half-written in the CDI root (its own names
/// only); the checkpoint's are cleared when it is loaded.
fn remove_stale_cdi_temps(cdi_root: &Path) {
    match crate::fsutil::remove_stale_temps(cdi_root, "gpuplane-") {
        Ok(removed) => {
            for path in removed {
                tracing::info!(path = %path.display(), "removed a temporary file left by an interrupted write");
            }
        }
        Err(e) => tracing::warn!(error = %e, "clearing stale temporary CDI files failed"),
    }
}

fn log_changes(changes: &[Change]) {
    for c in changes {
        match c {
            Change::Unhealthy { unit, cause } => {
                tracing::warn!(device = %unit, %cause, "device unhealthy")
            }
            Change::Recovered { unit, after } => {
                tracing::info!(device = %unit, after = %after, "device healthy again")
            }
            Change::Ignored { unit, xid } => {
                tracing::info!(device = %unit, xid, "Xid ignored by policy")
            }
        }
    }
}

/// Reads driver events on a thread of its own (NVML's wait blocks) into the health book.
fn spawn_event_pump(
    source: Arc<dyn DeviceSource>,
    state: Arc<NodeState>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut failing = false;
        while !stop.load(Ordering::Relaxed) {
            match source.next_event(Duration::from_millis(200)) {
                Ok(Some(event)) => {
                    failing = false;
                    let crate::source::DeviceEvent::Xid { xid, .. } = &event;
                    crate::metrics::global().inc(
                        "gpuplane_xid_events_total",
                        "Xid events reported by the driver, by code.",
                        &[("xid", &xid.to_string())],
                    );
                    let change = state.update(|s| {
                        let c = s
                            .health
                            .on_event(&event, Instant::now(), &s.config.xid_policy);
                        let changed = !matches!(c, Change::Ignored { .. });
                        (c, changed)
                    });
                    log_changes(&[change]);
                }
                Ok(None) => failing = false,
                Err(e) => {
                    if !failing {
                        tracing::error!(error = %e, "waiting for driver events failed; retrying");
                    }
                    failing = true;
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    })
}

/// Runs the agent until `shutdown` resolves, then stops serving and removes its sockets.
/// Fails at once, before touching any socket or file, if another agent holds the state
/// directory.
pub async fn run(
    opts: NodeOptions,
    source: Arc<dyn DeviceSource>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    // Held until this function returns; the kernel releases it if the process dies first.
    let _state_lock = lock::StateLock::acquire(&opts.paths.state_dir)?;
    crate::crashpoint::announce();
    let config_file = opts.config_file.as_deref();
    let config = load_config(config_file)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(NodeError::Signals)?;
    remove_stale_cdi_temps(&opts.paths.cdi_root);

    // The endpoints come first, answering from an empty inventory until discovery succeeds,
    // so a node waiting for its driver says why it is not ready.
    let nothing_yet = Inventory {
        driver_version: String::new(),
        cuda_driver_version: String::new(),
        gpus: Vec::new(),
        topology: crate::inventory::Topology::default(),
    };
    let state = Arc::new(NodeState::new(
        Snapshot::new(nothing_yet, config.clone()).map_err(NodeError::Plan)?,
    ));
    let dp_registered = Arc::new(AtomicBool::new(false));
    let readiness = Arc::new(http::Readiness {
        device_plugin: opts.device_plugin.then(|| dp_registered.clone()),
        dra: opts.dra.is_some().then(std::sync::OnceLock::new),
        discovery: std::sync::Mutex::new(Some("not attempted yet".into())),
        ..Default::default()
    });
    readiness.tick();
    let metrics_task = match opts.metrics_addr {
        Some(addr) => {
            let listener = http::bind(addr)
                .await
                .map_err(|source| NodeError::Metrics {
                    addr,
                    cause: source,
                })?;
            tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
            Some(tokio::spawn(http::serve(
                listener,
                state.clone(),
                readiness.clone(),
                stop_rx.clone(),
            )))
        }
        None => None,
    };

    let found = tokio::select! {
        found = discover_with_retry(&source, &readiness) => Some(found),
        _ = &mut shutdown => None,
    };
    let Some(found) = found else {
        let _ = stop_tx.send(true);
        if let Some(task) = metrics_task {
            let _ = task.await;
        }
        return Ok(());
    };
    for lost in &found.lost {
        tracing::warn!(gpu = lost.index, reason = %lost.reason, "GPU not answering; it is not offered");
    }
    let snapshot = Snapshot::new(found.inventory, config).map_err(NodeError::Plan)?;
    for w in &snapshot.plan.warnings {
        tracing::warn!("{w}");
    }
    for r in &snapshot.plan.resources {
        tracing::info!(resource = %r.name, devices = r.devices.len(), "offering");
    }
    state.update(|s| {
        *s = snapshot;
        ((), true)
    });

    let mut prober = probe::Prober::start(source.clone()).map_err(NodeError::ProbeThread)?;
    let pump_stop = Arc::new(AtomicBool::new(false));
    let pump = spawn_event_pump(source.clone(), state.clone(), pump_stop.clone());
    // Shared with Allocate, which must not hand out a CDI name whose spec is not written.
    let node_spec = Arc::new(cdi::NodeSpec::new(
        opts.paths.cdi_root.clone(),
        opts.paths.driver_root.clone(),
        opts.paths.driver_root_mount.clone(),
        opts.paths.dev_root.clone(),
        opts.device_mode,
    ));
    let registrar = opts.device_plugin.then(|| {
        tokio::spawn(registrar::run(
            opts.paths.device_plugins(),
            state.clone(),
            node_spec.clone(),
            dp_registered.clone(),
            stop_rx.clone(),
        ))
    });

    let dra_tasks = match opts.dra.clone() {
        Some(settings) => {
            let started = dra::start(
                settings,
                &opts.node_name,
                &opts.paths,
                opts.device_mode,
                state.clone(),
                stop_rx.clone(),
            )
            .await?;
            if let Some(cell) = &readiness.dra {
                let _ = cell.set(http::DraReadiness {
                    registered: started.registered,
                    published: started.published,
                });
            }
            started.tasks
        }
        None => Vec::new(),
    };
    let labels = opts.api.clone().map(|client| {
        tokio::spawn(labeler::run(
            client,
            opts.node_name.clone(),
            state.clone(),
            stop_rx.clone(),
        ))
    });
    let pod_resources = opts.device_plugin.then(|| {
        tokio::spawn(podresources::run(
            opts.paths.pod_resources_socket(),
            state.clone(),
            stop_rx.clone(),
        ))
    });
    let inventory_now = || state.read().inventory.clone();
    let mut spec_state = sync_spec(&node_spec, inventory_now()).await;
    let mut spec_checked = Instant::now();

    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_refresh = Instant::now();
    let mut config_mtime = mtime(config_file);
    loop {
        readiness.tick();
        let reload = tokio::select! {
            _ = &mut shutdown => break,
            _ = hangup.recv() => { tracing::info!("SIGHUP: reloading config"); true }
            _ = tick.tick() => {
                let now_mtime = mtime(config_file);
                let changed = now_mtime != config_mtime;
                config_mtime = now_mtime;
                if changed { tracing::info!("config file changed: reloading"); }
                changed
            }
        };
        let (quiet, refresh_every) = {
            let s = state.read();
            (s.config.recovery_quiet_period, s.config.inventory_refresh)
        };
        let mut changes = state.update(|s| {
            let c = s.health.expire_xids(Instant::now(), quiet);
            let changed = !c.is_empty();
            (c, changed)
        });
        // Lost GPUs are asked on the probe thread, never under the lock (see `probe`).
        if let Some(answer) = prober.poll() {
            changes.extend(state.update(|s| {
                let c = s.health.recover_answered(&answer.answered, answer.asked_at);
                let changed = !c.is_empty();
                (c, changed)
            }));
        }
        let lost = state.read().health.lost();
        prober.ask(lost);
        log_changes(&changes);
        // Waiting for device nodes: look again every second; otherwise only on inventory change.
        if spec_state == cdi::SpecState::Waiting && spec_checked.elapsed() >= Duration::from_secs(1)
        {
            spec_checked = Instant::now();
            spec_state = sync_spec(&node_spec, inventory_now()).await;
        }

        let mut config = state.read().config.clone();
        if reload {
            match load_config(config_file) {
                Ok(c) => config = c,
                Err(e) => {
                    tracing::error!(error = %e, "config reload failed; keeping the running config")
                }
            }
        }
        let refresh = last_refresh.elapsed() >= refresh_every;
        if !refresh && !reload {
            continue;
        }
        let mut inventory = state.read().inventory.clone();
        if refresh {
            last_refresh = Instant::now();
            let s = source.clone();
            match tokio::task::spawn_blocking(move || s.discover()).await {
                Ok(Ok(found)) => {
                    let (inv, lost) = with_lost(Some(&inventory), &found);
                    state.update(|s| {
                        let now = Instant::now();
                        let fresh: Vec<&String> = lost
                            .iter()
                            .filter(|u| s.health.health(u) != Health::Unhealthy(Cause::Lost))
                            .collect();
                        let newly: Vec<Change> = fresh
                            .into_iter()
                            .map(|u| s.health.on_lost(u, now))
                            .collect();
                        log_changes(&newly);
                        let changed = !newly.is_empty();
                        ((), changed)
                    });
                    inventory = inv;
                }
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "inventory refresh failed; serving the last known inventory")
                }
                Err(e) => {
                    tracing::error!(error = %e, "inventory refresh panicked; serving the last known inventory")
                }
            }
        }
        apply(&state, inventory, config);
        spec_state = sync_spec(&node_spec, inventory_now()).await;
    }

    tracing::info!("shutting down: stopping plugins");
    let _ = stop_tx.send(true);
    for task in [registrar, pod_resources, metrics_task, labels]
        .into_iter()
        .flatten()
        .chain(dra_tasks)
    {
        let _ = task.await;
    }
    pump_stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || pump.join()).await;
    Ok(())
}

/// Brings the node CDI spec in step with `inv` on the blocking pool (it writes and fsyncs).
async fn sync_spec(node_spec: &Arc<cdi::NodeSpec>, inv: Inventory) -> cdi::SpecState {
    let spec = node_spec.clone();
    tokio::task::spawn_blocking(move || spec.sync(&inv))
        .await
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "writing the node CDI spec panicked; retrying");
            cdi::SpecState::Waiting
        })
}

/// Installs a new inventory and config if they differ from the running ones.
fn apply(state: &NodeState, inventory: Inventory, config: AgentConfig) {
    state.update(|s| {
        if s.inventory == inventory && s.config == config {
            return ((), false);
        }
        let inventory_changed = s.inventory != inventory;
        match s.replace(inventory, config) {
            Ok(()) => {
                if inventory_changed {
                    tracing::info!(gpus = s.inventory.gpus.len(), mig_devices = s.inventory.mig_device_count(), "inventory changed");
                }
                for w in &s.plan.warnings {
                    tracing::warn!("{w}");
                }
                ((), true)
            }
            Err(e) => {
                tracing::error!(error = %e, "new inventory or config cannot be offered; keeping the previous plan");
                ((), false)
            }
        }
    });
}
