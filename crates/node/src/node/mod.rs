//! `gpuplane node`: start-up, the servers, the tasks around the state owner, and shutdown.
//!
//! [`run`] takes the state directory's lock, starts the HTTP endpoints (they answer, from an
//! empty inventory, while discovery waits for the driver), discovers with retry, then starts
//! the kubelet-facing servers (PodResources follower, DRA, then the device plugin registrar,
//! labeler) and the tasks ([`tasks`]) that post to the state owner ([`owner`]), which runs
//! until shutdown. Everything it starts takes its paths and a shutdown signal as arguments, so tests
//! run the real agent in-process against doubles in a temp dir.

pub mod apis;
pub mod deferred;
pub mod dra;
pub mod events;
pub mod health_marks;
pub mod http;
pub mod kept_sim;
pub mod labeler;
pub mod lock;
pub mod lost_gpus;
pub mod owner;
pub mod podresources;
pub mod sim_telemetry;
pub mod simulate;
pub mod tasks;

use crate::cdi::node_spec::NodeSpec;
use crate::config::{AgentConfig, ConfigError};
use crate::deviceplugin::registrar;
use crate::deviceplugin::resources::PlanError;
use crate::inventory::Inventory;
use crate::paths::HostPaths;
use crate::source::{DeviceMode, DeviceSource, Discovery};
use crate::state::{NodeState, Snapshot};
use crate::telemetry::idle_events::IdleEvents;
use crate::telemetry::{Telemetry, TelemetryOptions};
use gpuplane_model::report::chain;
use owner::{Input, Owner};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

#[derive(Clone)]
pub struct NodeOptions {
    pub node_name: String,
    pub paths: HostPaths,
    /// The agent config file; reloaded on SIGHUP and when it changes.
    pub config_file: Option<PathBuf>,
    /// The node's sharing switch (`gpuplane.dev/sharing`: `on`, `off`), over the config's
    /// `sharing.consumableCapacity`; `None`: the config decides.
    pub sharing_switch: Option<bool>,
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
    /// Device telemetry on /metrics; `None` samples nothing.
    pub telemetry: Option<TelemetryOptions>,
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
    /// The start-up's file work (lock, config, leftovers, saved state) did not finish.
    #[error("starting the agent: its start-up job did not finish: {0}")]
    StartWorker(String),
    /// The thread that probes lost GPUs could not be started.
    #[error("starting the device probe thread: {}", chain(.0))]
    ProbeThread(std::io::Error),
    /// A telemetry sampling thread could not be started.
    #[error("starting the telemetry sampling threads: {}", chain(.0))]
    TelemetryThread(std::io::Error),
}

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
    let mut pauses = crate::backoff::exponential(DISCOVERY_RETRY_FIRST, DISCOVERY_RETRY_MAX);
    let mut failures = 0u64;
    let waiting = |why: Option<String>| {
        readiness.discovery.send_replace(why);
    };
    loop {
        let s = source.clone();
        let why = match tokio::task::spawn_blocking(move || s.discover()).await {
            Ok(Ok(d)) => {
                waiting(None);
                return d;
            }
            Ok(Err(e)) => e.to_string(),
            Err(e) => format!("discovery panicked: {e}"),
        };
        failures += 1;
        let delay = pauses.next().unwrap_or(DISCOVERY_RETRY_MAX);
        crate::metrics::node().discovery_failures.inc();
        tracing::error!(error = %why, attempt = failures, retry_in = ?delay, "device discovery failed; retrying");
        waiting(Some(format!(
            "{failures} attempt(s) failed, retrying in {delay:?}: {why}"
        )));
        let until = Instant::now() + delay;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            readiness.tick();
            tokio::time::sleep(left.min(Duration::from_millis(250))).await;
        }
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

/// What the agent serves before discovery: no GPUs, no driver.
fn nothing_yet() -> Inventory {
    Inventory {
        driver_version: String::new(),
        cuda_driver_version: String::new(),
        gpus: Vec::new(),
        topology: crate::inventory::Topology::default(),
    }
}

/// What runs until shutdown: the tasks to await, the event pump to stop, and the signal that
/// stops them all.
struct Running {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    pump: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
    /// Set once the GPUs are discovered and sampled; read by /metrics.
    telemetry: Arc<OnceLock<Arc<Telemetry>>>,
}

impl Running {
    /// Stops serving, removes the sockets (each server does on stop) and waits for them.
    async fn stop(self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.telemetry.get() {
            t.stop();
        }
        for task in self.tasks {
            let _ = task.await;
        }
        if let Some((stop, pump)) = self.pump {
            stop.store(true, Ordering::Relaxed);
            let _ = tokio::task::spawn_blocking(move || pump.join()).await;
        }
    }
}

/// Takes the state directory's lock, reads the config file and clears the CDI root's
/// leftovers: file work (the lock is a flock retried with pauses), off the runtime.
async fn take_state(opts: &NodeOptions) -> Result<(lock::StateLock, AgentConfig), NodeError> {
    let (state_dir, cdi_root) = (opts.paths.state_dir.clone(), opts.paths.cdi_root.clone());
    let (config_file, switch) = (opts.config_file.clone(), opts.sharing_switch);
    tokio::task::spawn_blocking(move || {
        let held = lock::StateLock::acquire(&state_dir)?;
        let config = tasks::load_config(config_file.as_deref(), switch)?;
        remove_stale_cdi_temps(&cdi_root);
        Ok((held, config))
    })
    .await
    .map_err(|e| NodeError::StartWorker(e.to_string()))?
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
    let (_state_lock, config) = take_state(&opts).await?;
    crate::crashpoint::announce();
    let hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(NodeError::Signals)?;
    let mut shutdown = std::pin::pin!(shutdown);

    // The endpoints come first, answering from an empty inventory until discovery succeeds,
    // so a node waiting for its driver says why it is not ready.
    let state = Arc::new(NodeState::new(
        Snapshot::new(nothing_yet(), config.clone()).map_err(NodeError::Plan)?,
    ));
    let dp_registered = Arc::new(AtomicBool::new(false));
    let readiness = Arc::new(http::Readiness {
        device_plugin: opts.device_plugin.then(|| dp_registered.clone()),
        dra: opts.dra.is_some().then(std::sync::OnceLock::new),
        discovery: tokio::sync::watch::Sender::new(Some("not attempted yet".into())),
        ..Default::default()
    });
    readiness.tick();
    let (stop, stop_rx) = watch::channel(false);
    let mut running = Running {
        stop,
        tasks: Vec::new(),
        pump: None,
        telemetry: Arc::new(OnceLock::new()),
    };
    if let Some(addr) = opts.metrics_addr {
        let listener = http::bind(addr)
            .await
            .map_err(|cause| NodeError::Metrics { addr, cause })?;
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
        running.tasks.push(tokio::spawn(http::serve(
            listener,
            state.clone(),
            readiness.clone(),
            running.telemetry.clone(),
            stop_rx.clone(),
        )));
    }

    let found = tokio::select! {
        found = discover_with_retry(&source, &readiness) => Some(found),
        _ = &mut shutdown => None,
    };
    let result = match found {
        Some(found) => {
            // With the device plugin off, pods that another device plugin (NVIDIA's, or this
            // agent under an earlier config) placed still hold their GPUs: PodResources is
            // followed always, so DRA never hands those GPUs out again, and its first listing
            // is awaited wherever the kubelet serves it already.
            let await_pod_resources = opts.device_plugin
                || tokio::fs::try_exists(opts.paths.pod_resources_socket())
                    .await
                    .unwrap_or(false);
            let agent = Agent {
                opts: &opts,
                await_pod_resources,
                source: &source,
                state: &state,
                readiness: &readiness,
                dp_registered: &dp_registered,
                stop: &stop_rx,
            };
            agent
                .serve(found, config, hangup, &mut running, &mut shutdown)
                .await
        }
        None => Ok(()),
    };
    running.stop().await;
    result
}

/// What starting the servers and tasks needs, borrowed from [`run`].
struct Agent<'a> {
    opts: &'a NodeOptions,
    /// Whether slices and prepares wait for the PodResources follower's first listing: with
    /// the device plugin, or when the kubelet's PodResources socket exists at start (a kubelet
    /// that starts later is followed from then on).
    await_pod_resources: bool,
    source: &'a Arc<dyn DeviceSource>,
    state: &'a Arc<NodeState>,
    readiness: &'a Arc<http::Readiness>,
    dp_registered: &'a Arc<AtomicBool>,
    stop: &'a watch::Receiver<bool>,
}

impl Agent<'_> {
    /// Offers the first discovery, starts everything and runs the state owner until
    /// `shutdown`; what was started stays in `running` for [`Running::stop`], also on error.
    async fn serve(
        &self,
        found: Discovery,
        config: AgentConfig,
        hangup: tokio::signal::unix::Signal,
        running: &mut Running,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), NodeError> {
        let (state_dir, boot_file) = (self.opts.paths.state_dir.clone(), self.opts.paths.boot_id());
        let dra = self.opts.dra.is_some();
        // File reads, off the runtime: the boot, the saved Xid marks, and the instances the DRA
        // checkpoint says gpuplane made (read-only here; the DRA core loads it properly), so a
        // restart does not mistake them for another tool's.
        let (boot_id, marks, owned) = tokio::task::spawn_blocking(move || {
            let boot_id = crate::dra::checkpoint::read_boot_id(&boot_file);
            let marks = health_marks::read(&state_dir, boot_id.as_deref());
            let owned = dra
                .then(|| crate::dra::checkpoint::read(&state_dir).map(|d| d.mig_owned()))
                .flatten()
                .unwrap_or_default();
            (boot_id, marks, owned)
        })
        .await
        .map_err(|e| NodeError::StartWorker(e.to_string()))?;
        self.offer(found, config, &marks, owned)
            .map_err(NodeError::Plan)?;
        running.tasks.push(tokio::spawn(health_marks::keep(
            self.state.clone(),
            self.opts.paths.state_dir.clone(),
            boot_id,
            marks,
            self.stop.clone(),
        )));
        let (owner, inputs) = self.start(hangup, running).await?;
        owner.run(inputs, shutdown).await;
        tracing::info!("shutting down: stopping plugins");
        Ok(())
    }

    /// Installs the first discovery with the Xid marks the last agent saved, logging what is
    /// offered. Before any server starts: a GPU still in its quiet period is never offered.
    fn offer(
        &self,
        found: Discovery,
        config: AgentConfig,
        marks: &[crate::health::SavedMark],
        owned: std::collections::BTreeSet<crate::source::MigRequest>,
    ) -> Result<(), PlanError> {
        for lost in &found.lost {
            tracing::warn!(gpu = lost.index, reason = %lost.reason, "GPU not answering; it is not offered");
        }
        let quiet = config.recovery_quiet_period;
        let mut snapshot = Snapshot::with_mig_owned(found.inventory, config, owned)?;
        for unit in snapshot
            .health
            .restore(marks, Instant::now(), http::now_ms(), quiet)
        {
            tracing::warn!(device = %unit, "still unhealthy after the restart: its last critical Xid is within the quiet period");
        }
        // The kubelet kept the device plugin's assignments while we were away; until the
        // follower's first listing brings them into the ledger, nothing is published or
        // prepared on the strength of it.
        snapshot.awaiting_device_plugin_holds = self.await_pod_resources;
        for w in &snapshot.plan.warnings {
            tracing::warn!("{w}");
        }
        for r in &snapshot.plan.resources {
            tracing::info!(resource = %r.name, devices = r.devices.len(), "offering");
        }
        self.state.update(|s| {
            *s = snapshot;
            ((), true)
        });
        Ok(())
    }

    /// Starts the kubelet-facing servers and the tasks around the state owner, recording them
    /// in `running`; the owner and its inputs to run.
    async fn start(
        &self,
        hangup: tokio::signal::unix::Signal,
        running: &mut Running,
    ) -> Result<(Owner, mpsc::UnboundedReceiver<Input>), NodeError> {
        let prober =
            lost_gpus::Prober::start(self.source.clone()).map_err(NodeError::ProbeThread)?;
        let opts = self.opts;
        // Shared with Allocate, which must not hand out a CDI name whose spec is not written.
        let node_spec = Arc::new(NodeSpec::new(opts.paths.clone(), opts.device_mode));
        self.start_servers(&node_spec, running).await?;
        self.start_telemetry(running)?;
        let inbox = self.start_tasks(node_spec, hangup, running);
        let owner = Owner {
            state: self.state.clone(),
            prober,
            readiness: self.readiness.clone(),
        };
        Ok((owner, inbox))
    }

    /// The PodResources follower, DRA, the device plugin registrar and the node labeler, as
    /// the options ask. DRA starts before the registrar: its checkpoint's holds must be in the
    /// ledger before ListAndWatch offers anything, or a GPU a running claim holds would be
    /// offered as Healthy, and an Allocate in that window could hand it out a second time.
    async fn start_servers(
        &self,
        node_spec: &Arc<NodeSpec>,
        running: &mut Running,
    ) -> Result<(), NodeError> {
        let (opts, state, stop) = (self.opts, self.state, self.stop);
        running.tasks.push(tokio::spawn(podresources::run(
            opts.paths.pod_resources_socket(),
            state.clone(),
            stop.clone(),
        )));
        if let Some(settings) = opts.dra.clone() {
            let started = dra::start(
                settings,
                &opts.node_name,
                &opts.paths,
                opts.device_mode,
                (state.clone(), self.source.clone()),
                stop.clone(),
            )
            .await?;
            if let Some(cell) = &self.readiness.dra {
                let _ = cell.set(http::DraReadiness {
                    registered: started.registered,
                    published: started.published,
                });
            }
            running.tasks.extend(started.tasks);
        }
        if opts.device_plugin {
            running.tasks.push(tokio::spawn(registrar::run(
                opts.paths.device_plugins(),
                state.clone(),
                node_spec.clone(),
                self.dp_registered.clone(),
                stop.clone(),
            )));
        }
        if let Some(client) = opts.api.clone() {
            running.tasks.push(tokio::spawn(labeler::run(
                client,
                opts.node_name.clone(),
                state.clone(),
                stop.clone(),
            )));
        }
        Ok(())
    }

    /// The sampling threads and, with API access, the pod follower, for the GPUs discovered.
    fn start_telemetry(&self, running: &mut Running) -> Result<(), NodeError> {
        let Some(opts) = &self.opts.telemetry else {
            return Ok(());
        };
        let telemetry = Arc::new(
            Telemetry::start(self.source.clone(), self.state.clone(), opts)
                .map_err(NodeError::TelemetryThread)?,
        );
        let client = self.opts.api.clone();
        if let Some(client) = client.clone() {
            running
                .tasks
                .push(tokio::spawn(crate::telemetry::pods::follow(
                    client,
                    self.opts.node_name.clone(),
                    telemetry.pods(),
                    self.stop.clone(),
                )));
        }
        let events = opts.idle.and(client).map(|client| IdleEvents {
            client,
            driver: self
                .opts
                .dra
                .as_ref()
                .map_or_else(|| "gpuplane-node".to_string(), |d| d.driver_name.clone()),
            node: self.opts.node_name.clone(),
        });
        running
            .tasks
            .push(tokio::spawn(crate::telemetry::rounds::watch(
                telemetry.clone(),
                self.state.clone(),
                opts.idle,
                events,
                opts.interval,
                self.stop.clone(),
            )));
        // Set once per run, here only: a second set cannot happen.
        let _ = running.telemetry.set(telemetry);
        Ok(())
    }

    /// The tasks that post to the state owner, and the node CDI spec keeper; the owner's inbox.
    fn start_tasks(
        &self,
        node_spec: Arc<NodeSpec>,
        hangup: tokio::signal::unix::Signal,
        running: &mut Running,
    ) -> mpsc::UnboundedReceiver<Input> {
        let (state, stop) = (self.state, self.stop);
        let (inputs, inbox) = mpsc::unbounded_channel();
        let pump_stop = Arc::new(AtomicBool::new(false));
        let pump = tasks::spawn_event_pump(self.source.clone(), inputs.clone(), pump_stop.clone());
        running.pump = Some((pump_stop, pump));
        running.tasks.push(tokio::spawn(tasks::keep_node_spec(
            node_spec,
            state.clone(),
            stop.clone(),
        )));
        running.tasks.push(tokio::spawn(tasks::watch_config(
            self.opts.config_file.clone(),
            self.opts.sharing_switch,
            hangup,
            inputs.clone(),
            stop.clone(),
        )));
        running.tasks.push(tokio::spawn(tasks::refresh_inventory(
            self.source.clone(),
            state.clone(),
            inputs,
            stop.clone(),
        )));
        inbox
    }
}
