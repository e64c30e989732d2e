//! A kubelet double for DRA: the plugin watcher on `<root>/plugins_registry/` and the DRA
//! manager's calls, following the real kubelet's semantics.
//!
//! Every [`SCAN`] it looks for `*.sock` files in `plugins_registry/`. For each new one (a socket
//! file it has not handled yet, by inode) it does what the kubelet's plugin watcher and DRA
//! registration handler do: `GetInfo`, check the type is `DRAPlugin` and the endpoint absolute,
//! pick the first DRA service in its own preference order that the plugin lists (v1 before
//! v1beta1 by default; configurable to speak v1beta1 only), dial the endpoint and answer
//! `NotifyRegistrationStatus` (false with the reason when it refuses). A socket that disappears
//! deregisters its driver and ends its health stream; a re-created one registers again.
//! Transport failures are retried on the next scan.
//!
//! `prepare`/`unprepare` call the chosen version with the kubelet's 45 s call timeout and fail
//! as the kubelet does when a claim is left out of the answer. `watch_health` follows
//! `NodeWatchResources` (and re-opens it after every re-registration, as the kubelet does) on
//! the health version picked at registration the way a 1.37 kubelet picks it: the first of its
//! own list (`v1.DRAResourceHealth`, then `v1alpha1.DRAResourceHealth`) that the plugin lists,
//! whatever the plugin's order; one stream, no fallback at run time. Both versions' messages are
//! kept as v1 (they are wire-identical apart from the package).
//! `restart` models a kubelet restart: plugin sockets are not deleted, the kubelet forgets every
//! registration and re-discovers the sockets.
//!
//! This module holds the double's state and its public face; `watcher.rs` is the plugin
//! watcher, `calls.rs` the prepare and unprepare calls, `health.rs` the health stream.

mod calls;
mod health;
mod watcher;

pub use calls::WireClaim;

use gpuplane_node::proto::dra_health_v1 as health_pb;
use gpuplane_node::proto::pluginregistration_v1 as reg_pb;
use health::start_health;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::Status;
use watcher::{scan, FileId};

/// How often `plugins_registry/` is scanned.
pub const SCAN: Duration = Duration::from_millis(100);
/// The kubelet's timeout for DRA plugin calls.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(45);
/// A kubelet DRA API version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DraVersion {
    V1,
    V1beta1,
}

impl DraVersion {
    /// The service name plugins list in `supported_versions`.
    pub fn service(self) -> &'static str {
        match self {
            DraVersion::V1 => "v1.DRAPlugin",
            DraVersion::V1beta1 => "v1beta1.DRAPlugin",
        }
    }
}

/// A kubelet DRA health API (`DRAResourceHealth`) version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HealthVersion {
    V1,
    V1alpha1,
}

impl HealthVersion {
    /// The service name plugins list in `supported_versions`.
    pub fn service(self) -> &'static str {
        match self {
            HealthVersion::V1 => "v1.DRAResourceHealth",
            HealthVersion::V1alpha1 => "v1alpha1.DRAResourceHealth",
        }
    }
}

/// How the double behaves.
#[derive(Debug, Clone)]
pub struct KubeletDraOptions {
    /// The DRA versions this kubelet speaks, most preferred first.
    pub versions: Vec<DraVersion>,
    /// The health versions this kubelet speaks, most preferred first.
    pub health_versions: Vec<HealthVersion>,
    /// Timeout of prepare and unprepare calls.
    pub call_timeout: Duration,
}

impl Default for KubeletDraOptions {
    /// A 1.37 kubelet: DRA v1, then v1beta1; health v1, then v1alpha1.
    fn default() -> Self {
        KubeletDraOptions {
            versions: vec![DraVersion::V1, DraVersion::V1beta1],
            health_versions: vec![HealthVersion::V1, HealthVersion::V1alpha1],
            call_timeout: CALL_TIMEOUT,
        }
    }
}

impl KubeletDraOptions {
    /// An older kubelet that only speaks v1beta1.
    pub fn v1beta1_only() -> Self {
        KubeletDraOptions {
            versions: vec![DraVersion::V1beta1],
            ..Self::default()
        }
    }

    /// A 1.34-1.36 kubelet, whose only health client is v1alpha1.
    pub fn v1alpha1_health_only() -> Self {
        KubeletDraOptions {
            health_versions: vec![HealthVersion::V1alpha1],
            ..Self::default()
        }
    }
}

/// What the double knows of one registered driver.
#[derive(Debug, Clone)]
pub struct DraPluginView {
    /// The registration socket it came from.
    pub registration_socket: PathBuf,
    /// `GetInfo`'s answer, verbatim.
    pub info: reg_pb::PluginInfo,
    pub endpoint: PathBuf,
    /// The version prepare/unprepare use.
    pub version: DraVersion,
    /// The health version chosen at registration; `None` when the plugin offers none this
    /// kubelet speaks.
    pub health: Option<HealthVersion>,
}

/// One registration attempt that got an answer from the plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrationEvent {
    pub socket: PathBuf,
    /// The name from `GetInfo`.
    pub driver: String,
    /// The chosen version, or why the kubelet refused (as sent in NotifyRegistrationStatus).
    pub outcome: Result<DraVersion, String>,
}

/// The health stream of one driver, as the kubelet sees it.
#[derive(Debug, Clone, Default)]
pub struct HealthView {
    /// The version of the stream opened last.
    pub version: Option<HealthVersion>,
    /// The latest list received, as v1 messages whatever the version.
    pub devices: Vec<health_pb::DeviceHealth>,
    /// How many messages arrived (over all streams of this driver).
    pub updates: u64,
    /// Whether a stream is open now.
    pub open: bool,
}

impl HealthView {
    /// The health of `pool/device` in the latest list.
    pub fn health(&self, pool: &str, device: &str) -> Option<health_pb::HealthStatus> {
        self.devices
            .iter()
            .find(|d| {
                d.device
                    .as_ref()
                    .is_some_and(|id| id.pool_name == pool && id.device_name == device)
            })
            .map(|d| {
                health_pb::HealthStatus::try_from(d.health)
                    .unwrap_or(health_pb::HealthStatus::Unknown)
            })
    }
}

struct Plugin {
    view: DraPluginView,
    /// The identity of the registration socket it came from; gone or replaced = deregistered.
    socket_id: FileId,
    channel: Channel,
    health_task: Option<JoinHandle<()>>,
}

impl Plugin {
    fn stop_health(&mut self) {
        if let Some(t) = self.health_task.take() {
            t.abort();
        }
    }
}

struct Inner {
    options: KubeletDraOptions,
    plugins: Mutex<BTreeMap<String, Plugin>>,
    /// Registration sockets handled (registered or refused), by path, with their identity.
    seen: Mutex<BTreeMap<PathBuf, FileId>>,
    events: Mutex<Vec<RegistrationEvent>>,
    health: Mutex<BTreeMap<String, HealthView>>,
    /// Drivers whose health stream `watch_health` asked for.
    health_wanted: Mutex<BTreeSet<String>>,
    changed: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    fn bump(&self) {
        self.changed.send_modify(|g| *g += 1);
    }

    fn forget_all(&self) {
        for p in lock(&self.plugins).values_mut() {
            p.stop_health();
        }
        lock(&self.plugins).clear();
        lock(&self.seen).clear();
        for h in lock(&self.health).values_mut() {
            h.open = false;
        }
        self.bump();
    }
}

/// A kubelet's DRA side: plugin watcher plus DRA manager calls.
pub struct KubeletDraDouble {
    dir: PathBuf,
    inner: Arc<Inner>,
    watcher: Option<(watch::Sender<bool>, JoinHandle<()>)>,
}

impl KubeletDraDouble {
    /// Starts watching `<kubelet_root>/plugins_registry/` (created if missing); must run inside a
    /// Tokio runtime.
    pub fn start(kubelet_root: &Path, options: KubeletDraOptions) -> KubeletDraDouble {
        let (changed, _) = watch::channel(0);
        let inner = Arc::new(Inner {
            options,
            plugins: Mutex::new(BTreeMap::new()),
            seen: Mutex::new(BTreeMap::new()),
            events: Mutex::new(Vec::new()),
            health: Mutex::new(BTreeMap::new()),
            health_wanted: Mutex::new(BTreeSet::new()),
            changed,
        });
        let dir = kubelet_root.join("plugins_registry");
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "kubelet DRA double: cannot create plugins_registry");
        }
        let mut k = KubeletDraDouble {
            dir,
            inner,
            watcher: None,
        };
        k.watch();
        k
    }

    fn watch(&mut self) {
        let (stop, mut stopped) = watch::channel(false);
        let inner = self.inner.clone();
        let dir = self.dir.clone();
        let task = tokio::spawn(async move {
            loop {
                scan(&inner, &dir).await;
                tokio::select! {
                    _ = tokio::time::sleep(SCAN) => {}
                    _ = stopped.wait_for(|s| *s) => return,
                }
            }
        });
        self.watcher = Some((stop, task));
    }

    /// Stops watching and forgets every registration (a kubelet that went away).
    pub async fn stop(&mut self) {
        if let Some((stop, task)) = self.watcher.take() {
            let _ = stop.send(true);
            let _ = task.await;
        }
        self.inner.forget_all();
    }

    /// A kubelet restart: forget every registration and health stream, then re-discover the
    /// sockets in `plugins_registry/` (which a restart leaves in place).
    pub async fn restart(&mut self) {
        self.stop().await;
        self.watch();
    }

    /// Drivers registered now.
    pub fn registered_drivers(&self) -> Vec<String> {
        lock(&self.inner.plugins).keys().cloned().collect()
    }

    pub fn plugin(&self, driver: &str) -> Option<DraPluginView> {
        lock(&self.inner.plugins)
            .get(driver)
            .map(|p| p.view.clone())
    }

    /// Every registration attempt that reached a verdict, oldest first.
    pub fn registrations(&self) -> Vec<RegistrationEvent> {
        lock(&self.inner.events).clone()
    }

    /// The health stream of `driver` as seen now.
    pub fn health(&self, driver: &str) -> Option<HealthView> {
        lock(&self.inner.health).get(driver).cloned()
    }

    /// Waits until `check` holds; on time-out says what the double saw.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        what: &str,
        check: impl Fn(&Self) -> bool,
    ) -> Result<(), String> {
        let mut changes = self.inner.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if check(self) {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(format!(
                    "timed out after {timeout:?} waiting for {what}; kubelet DRA double has drivers {:?}, registrations {:?}",
                    self.registered_drivers(),
                    self.registrations()
                ));
            }
        }
    }

    /// Waits until `driver` is registered.
    pub async fn wait_registered(
        &self,
        driver: &str,
        timeout: Duration,
    ) -> Result<DraPluginView, String> {
        self.wait_until(timeout, &format!("{driver} to register"), |k| {
            k.plugin(driver).is_some()
        })
        .await?;
        self.plugin(driver)
            .ok_or_else(|| format!("{driver} deregistered again"))
    }

    /// Waits until `check` holds for the health stream of `driver`.
    pub async fn wait_health(
        &self,
        driver: &str,
        timeout: Duration,
        check: impl Fn(&HealthView) -> bool,
    ) -> Result<HealthView, String> {
        let mut changes = self.inner.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.health(driver);
            if let Some(h) = now.as_ref().filter(|h| check(h)) {
                return Ok(h.clone());
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(format!(
                    "timed out after {timeout:?} waiting on the health of {driver}; saw {now:?}"
                ));
            }
        }
    }

    fn connection(&self, driver: &str) -> Result<(DraVersion, Channel), Status> {
        let plugins = lock(&self.inner.plugins);
        let p = plugins
            .get(driver)
            .ok_or_else(|| Status::not_found(format!("DRA driver {driver} is not registered")))?;
        Ok((p.view.version, p.channel.clone()))
    }

    /// Opens `driver`'s health stream and keeps the latest list (see [`Self::health`]); the
    /// stream is re-opened whenever the driver registers again.
    pub fn watch_health(&self, driver: &str) -> Result<(), Status> {
        lock(&self.inner.health_wanted).insert(driver.to_string());
        let mut plugins = lock(&self.inner.plugins);
        let p = plugins
            .get_mut(driver)
            .ok_or_else(|| Status::not_found(format!("DRA driver {driver} is not registered")))?;
        if p.view.health.is_none() {
            let ours: Vec<&str> = self
                .inner
                .options
                .health_versions
                .iter()
                .map(|v| v.service())
                .collect();
            return Err(Status::failed_precondition(format!(
                "DRA driver {driver} offers none of the health services {ours:?} (it lists {:?})",
                p.view.info.supported_versions
            )));
        }
        start_health(&self.inner, driver, p);
        Ok(())
    }
}

impl Drop for KubeletDraDouble {
    fn drop(&mut self) {
        if let Some((_, task)) = self.watcher.take() {
            task.abort();
        }
        for p in lock(&self.inner.plugins).values_mut() {
            p.stop_health();
        }
    }
}
