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

use gpuplane_shell::dra::service::RawClaim;
use gpuplane_shell::dra::{ClaimRef, PrepareResult, PreparedDevice};
use gpuplane_shell::grpc;
use gpuplane_shell::proto::dra_health_v1 as health_pb;
use gpuplane_shell::proto::dra_health_v1alpha1 as health_v1alpha1;
use gpuplane_shell::proto::pluginregistration_v1 as reg_pb;
use gpuplane_shell::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Request, Status};

/// How often `plugins_registry/` is scanned.
pub const SCAN: Duration = Duration::from_millis(100);
/// The kubelet's timeout for DRA plugin calls.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(45);
/// How long the watcher waits for a registration socket to answer.
const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(5);

const PLUGIN_TYPE: &str = "DRAPlugin";

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

#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error(transparent)]
    Socket(#[from] grpc::SocketError),
    #[error("{call}: {status}")]
    Call { call: &'static str, status: Status },
    #[error("{0} did not answer within {REGISTRATION_TIMEOUT:?}")]
    Timeout(&'static str),
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

    /// NodePrepareResources for `claims` of `driver`, over the negotiated version.
    pub async fn prepare(
        &self,
        driver: &str,
        claims: &[impl WireClaim],
    ) -> Result<BTreeMap<String, PrepareResult>, Status> {
        let (version, channel) = self.connection(driver)?;
        let timeout = self.inner.options.call_timeout;
        let answers: HashMap<String, PrepareResult> = match version {
            DraVersion::V1 => {
                let claims = claims.iter().map(|c| v1::Claim {
                    namespace: c.namespace().to_string(),
                    uid: c.uid().to_string(),
                    name: c.name().to_string(),
                });
                let mut req = Request::new(v1::NodePrepareResourcesRequest {
                    claims: claims.collect(),
                });
                req.set_timeout(timeout);
                let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
                let resp = bounded(
                    timeout,
                    "NodePrepareResources",
                    client.node_prepare_resources(req),
                )
                .await?;
                resp.claims
                    .into_iter()
                    .map(|(uid, r)| {
                        let result = if r.error.is_empty() {
                            Ok(r.devices.into_iter().map(from_v1).collect())
                        } else {
                            Err(r.error)
                        };
                        (uid, result)
                    })
                    .collect()
            }
            DraVersion::V1beta1 => {
                let claims = claims.iter().map(|c| v1beta1::Claim {
                    namespace: c.namespace().to_string(),
                    uid: c.uid().to_string(),
                    name: c.name().to_string(),
                });
                let mut req = Request::new(v1beta1::NodePrepareResourcesRequest {
                    claims: claims.collect(),
                });
                req.set_timeout(timeout);
                let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
                let resp = bounded(
                    timeout,
                    "NodePrepareResources",
                    client.node_prepare_resources(req),
                )
                .await?;
                resp.claims
                    .into_iter()
                    .map(|(uid, r)| {
                        let result = if r.error.is_empty() {
                            Ok(r.devices.into_iter().map(from_v1beta1).collect())
                        } else {
                            Err(r.error)
                        };
                        (uid, result)
                    })
                    .collect()
            }
        };
        every_claim("NodePrepareResources", claims, answers)
    }

    /// NodeUnprepareResources for `claims` of `driver`, over the negotiated version.
    pub async fn unprepare(
        &self,
        driver: &str,
        claims: &[impl WireClaim],
    ) -> Result<BTreeMap<String, Result<(), String>>, Status> {
        let (version, channel) = self.connection(driver)?;
        let timeout = self.inner.options.call_timeout;
        let verdict = |error: String| if error.is_empty() { Ok(()) } else { Err(error) };
        let answers: HashMap<String, Result<(), String>> = match version {
            DraVersion::V1 => {
                let claims = claims.iter().map(|c| v1::Claim {
                    namespace: c.namespace().to_string(),
                    uid: c.uid().to_string(),
                    name: c.name().to_string(),
                });
                let mut req = Request::new(v1::NodeUnprepareResourcesRequest {
                    claims: claims.collect(),
                });
                req.set_timeout(timeout);
                let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
                let resp = bounded(
                    timeout,
                    "NodeUnprepareResources",
                    client.node_unprepare_resources(req),
                )
                .await?;
                resp.claims
                    .into_iter()
                    .map(|(uid, r)| (uid, verdict(r.error)))
                    .collect()
            }
            DraVersion::V1beta1 => {
                let claims = claims.iter().map(|c| v1beta1::Claim {
                    namespace: c.namespace().to_string(),
                    uid: c.uid().to_string(),
                    name: c.name().to_string(),
                });
                let mut req = Request::new(v1beta1::NodeUnprepareResourcesRequest {
                    claims: claims.collect(),
                });
                req.set_timeout(timeout);
                let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
                let resp = bounded(
                    timeout,
                    "NodeUnprepareResources",
                    client.node_unprepare_resources(req),
                )
                .await?;
                resp.claims
                    .into_iter()
                    .map(|(uid, r)| (uid, verdict(r.error)))
                    .collect()
            }
        };
        every_claim("NodeUnprepareResources", claims, answers)
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

async fn bounded<T>(
    timeout: Duration,
    call: &str,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, Status> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result.map(tonic::Response::into_inner),
        Err(_) => Err(Status::deadline_exceeded(format!(
            "{call} did not answer within {timeout:?}"
        ))),
    }
}

/// A claim as the kubelet puts it on the wire: three strings nobody has checked yet. Tests send
/// checked claims ([`ClaimRef`]) and hostile ones ([`RawClaim`]) alike.
pub trait WireClaim {
    fn namespace(&self) -> &str;
    fn uid(&self) -> &str;
    fn name(&self) -> &str;
}

impl WireClaim for ClaimRef {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn uid(&self) -> &str {
        &self.uid
    }
    fn name(&self) -> &str {
        &self.name
    }
}

impl WireClaim for RawClaim {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn uid(&self) -> &str {
        &self.uid
    }
    fn name(&self) -> &str {
        &self.name
    }
}

/// As the kubelet: a claim missing from the answer fails the call; extra entries are ignored.
fn every_claim<T>(
    call: &str,
    claims: &[impl WireClaim],
    mut answers: HashMap<String, T>,
) -> Result<BTreeMap<String, T>, Status> {
    let mut out = BTreeMap::new();
    let mut missing = Vec::new();
    for c in claims {
        match answers.remove(c.uid()) {
            Some(a) => {
                out.insert(c.uid().to_string(), a);
            }
            None if out.contains_key(c.uid()) => {}
            None => missing.push(c.uid().to_string()),
        }
    }
    if !missing.is_empty() {
        return Err(Status::internal(format!(
            "{call} left out {} claims: {missing:?}",
            missing.len()
        )));
    }
    Ok(out)
}

fn from_v1(d: v1::Device) -> PreparedDevice {
    PreparedDevice {
        requests: d.request_names,
        pool: d.pool_name,
        device: d.device_name,
        cdi_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

fn from_v1beta1(d: v1beta1::Device) -> PreparedDevice {
    PreparedDevice {
        requests: d.request_names,
        pool: d.pool_name,
        device: d.device_name,
        cdi_ids: d.cdi_device_ids,
        share_id: None,
    }
}

fn start_health(inner: &Arc<Inner>, driver: &str, plugin: &mut Plugin) {
    plugin.stop_health();
    let Some(version) = plugin.view.health else {
        return;
    };
    let task_inner = inner.clone();
    let name = driver.to_string();
    let channel = plugin.channel.clone();
    plugin.health_task = Some(tokio::spawn(async move {
        if let Err(e) = follow_health(&task_inner, &name, version, channel).await {
            tracing::debug!(driver = %name, error = %e, "kubelet DRA double: health stream ended");
        }
        if let Some(h) = lock(&task_inner.health).get_mut(&name) {
            h.open = false;
        }
        task_inner.bump();
    }));
}

/// Opens the stream on `version` and follows it until it ends.
async fn follow_health(
    inner: &Arc<Inner>,
    driver: &str,
    version: HealthVersion,
    channel: Channel,
) -> Result<(), Status> {
    match version {
        HealthVersion::V1 => {
            let mut client =
                health_pb::dra_resource_health_client::DraResourceHealthClient::new(channel);
            let stream = client
                .node_watch_resources(health_pb::NodeWatchResourcesRequest {})
                .await?
                .into_inner();
            follow_stream(inner, driver, version, stream, |m| m.devices).await
        }
        HealthVersion::V1alpha1 => {
            let mut client =
                health_v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel);
            let stream = client
                .node_watch_resources(health_v1alpha1::NodeWatchResourcesRequest {})
                .await?
                .into_inner();
            follow_stream(inner, driver, version, stream, |m| {
                m.devices.into_iter().map(v1_from_v1alpha1).collect()
            })
            .await
        }
    }
}

/// Keeps the latest list of an open stream, whatever its version.
async fn follow_stream<M>(
    inner: &Arc<Inner>,
    driver: &str,
    version: HealthVersion,
    mut stream: tonic::Streaming<M>,
    devices: impl Fn(M) -> Vec<health_pb::DeviceHealth>,
) -> Result<(), Status> {
    {
        let mut health = lock(&inner.health);
        let view = health.entry(driver.to_string()).or_default();
        view.open = true;
        view.version = Some(version);
    }
    inner.bump();
    while let Some(msg) = stream.message().await? {
        let mut health = lock(&inner.health);
        let view = health.entry(driver.to_string()).or_default();
        view.devices = devices(msg);
        view.updates += 1;
        view.open = true;
        drop(health);
        inner.bump();
    }
    Ok(())
}

/// A v1alpha1 device health as the v1 message with the same fields.
fn v1_from_v1alpha1(d: health_v1alpha1::DeviceHealth) -> health_pb::DeviceHealth {
    health_pb::DeviceHealth {
        device: d.device.map(|id| health_pb::DeviceIdentifier {
            pool_name: id.pool_name,
            device_name: id.device_name,
        }),
        // Same enum numbers in both packages.
        health: d.health,
        last_updated_time: d.last_updated_time,
        health_check_timeout_seconds: d.health_check_timeout_seconds,
        message: d.message,
    }
}

/// A socket file's identity; inode numbers are reused at once on some file systems, so the
/// modification time (set when the socket is bound) is part of it.
type FileId = (u64, u64, i64, i64);

/// The sockets in `dir` now, by path, with their identity.
fn sockets(dir: &Path) -> BTreeMap<PathBuf, FileId> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            !name.starts_with('.') && name.ends_with(".sock")
        })
        .filter_map(|e| {
            let m = std::fs::symlink_metadata(e.path()).ok()?;
            m.file_type()
                .is_socket()
                .then(|| (e.path(), (m.dev(), m.ino(), m.mtime(), m.mtime_nsec())))
        })
        .collect()
}

async fn scan(inner: &Arc<Inner>, dir: &Path) {
    let now = sockets(dir);
    // Sockets that vanished or were replaced: deregister what came from them.
    lock(&inner.seen).retain(|path, id| now.get(path) == Some(id));
    let mut gone = Vec::new();
    lock(&inner.plugins).retain(|driver, p| {
        let keep = now.get(&p.view.registration_socket) == Some(&p.socket_id);
        if !keep {
            p.stop_health();
            tracing::info!(driver = %driver, socket = %p.view.registration_socket.display(), "kubelet DRA double: plugin deregistered");
            gone.push(driver.clone());
        }
        keep
    });
    if !gone.is_empty() {
        let mut health = lock(&inner.health);
        for d in &gone {
            if let Some(h) = health.get_mut(d) {
                h.open = false;
            }
        }
        drop(health);
        inner.bump();
    }
    for (path, id) in now {
        if lock(&inner.seen).get(&path) == Some(&id) {
            continue;
        }
        match register(inner, &path, id).await {
            Ok(()) => {
                lock(&inner.seen).insert(path, id);
            }
            Err(e) => {
                tracing::debug!(socket = %path.display(), error = %e, "kubelet DRA double: registration attempt failed; retrying");
            }
        }
    }
}

/// One plugin watcher registration. `Ok` once the plugin got a verdict (registered or refused);
/// `Err` for transport failures, which are retried.
async fn register(
    inner: &Arc<Inner>,
    socket: &Path,
    socket_id: FileId,
) -> Result<(), RegisterError> {
    // As the real plugin watcher dials: a bare path target, so grpc-go sends the percent-encoded
    // socket path as `:authority`.
    let channel = tokio::time::timeout(
        REGISTRATION_TIMEOUT,
        super::dial::connect(socket, super::dial::Authority::EncodedPath),
    )
    .await
    .map_err(|_| RegisterError::Timeout("registration socket"))??;
    let mut client = reg_pb::registration_client::RegistrationClient::new(channel);
    let info = tokio::time::timeout(
        REGISTRATION_TIMEOUT,
        client.get_info(reg_pb::InfoRequest {}),
    )
    .await
    .map_err(|_| RegisterError::Timeout("GetInfo"))?
    .map_err(|status| RegisterError::Call {
        call: "GetInfo",
        status,
    })?
    .into_inner();
    let verdict = match validate(&inner.options, &info) {
        Ok((version, health)) => {
            let endpoint = PathBuf::from(&info.endpoint);
            match tokio::time::timeout(REGISTRATION_TIMEOUT, grpc::connect(&endpoint)).await {
                Ok(Ok(channel)) => Ok((version, health, endpoint, channel)),
                Ok(Err(e)) => Err(format!("cannot dial DRA endpoint: {e}")),
                Err(_) => Err(format!(
                    "DRA endpoint {} did not answer within {REGISTRATION_TIMEOUT:?}",
                    endpoint.display()
                )),
            }
        }
        Err(e) => Err(e),
    };
    let status = match &verdict {
        Ok(_) => reg_pb::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        },
        Err(e) => reg_pb::RegistrationStatus {
            plugin_registered: false,
            error: e.clone(),
        },
    };
    // Like the kubelet: the plugin is in the store before it hears the verdict.
    let outcome = match verdict {
        Ok((version, health, endpoint, channel)) => {
            let view = DraPluginView {
                registration_socket: socket.to_path_buf(),
                info: info.clone(),
                endpoint,
                version,
                health,
            };
            let mut plugin = Plugin {
                view,
                socket_id,
                channel,
                health_task: None,
            };
            if health.is_some() && lock(&inner.health_wanted).contains(&info.name) {
                start_health(inner, &info.name, &mut plugin);
            }
            if let Some(mut old) = lock(&inner.plugins).insert(info.name.clone(), plugin) {
                old.stop_health();
            }
            tracing::info!(driver = %info.name, version = version.service(), "kubelet DRA double: plugin registered");
            Ok(version)
        }
        Err(e) => {
            tracing::warn!(driver = %info.name, socket = %socket.display(), error = %e, "kubelet DRA double: plugin refused");
            Err(e)
        }
    };
    lock(&inner.events).push(RegistrationEvent {
        socket: socket.to_path_buf(),
        driver: info.name.clone(),
        outcome,
    });
    inner.bump();
    tokio::time::timeout(
        REGISTRATION_TIMEOUT,
        client.notify_registration_status(status),
    )
    .await
    .map_err(|_| RegisterError::Timeout("NotifyRegistrationStatus"))?
    .map_err(|status| RegisterError::Call {
        call: "NotifyRegistrationStatus",
        status,
    })?;
    Ok(())
}

/// The kubelet's checks on `GetInfo`: the DRA version to use and the health version, if any.
/// Both are picked in the kubelet's own order of preference, not the plugin's.
fn validate(
    options: &KubeletDraOptions,
    info: &reg_pb::PluginInfo,
) -> Result<(DraVersion, Option<HealthVersion>), String> {
    if info.r#type != PLUGIN_TYPE {
        return Err(format!(
            "plugin type {:?} is not {PLUGIN_TYPE}",
            info.r#type
        ));
    }
    if info.name.is_empty() {
        return Err("plugin name is empty".into());
    }
    if !Path::new(&info.endpoint).is_absolute() {
        return Err(format!(
            "endpoint {:?} is not an absolute path",
            info.endpoint
        ));
    }
    let version = options
        .versions
        .iter()
        .copied()
        .find(|v| info.supported_versions.iter().any(|s| s == v.service()))
        .ok_or_else(|| {
            let ours: Vec<&str> = options.versions.iter().map(|v| v.service()).collect();
            format!(
                "none of the offered services {:?} is supported (kubelet speaks {ours:?})",
                info.supported_versions
            )
        })?;
    let health = options
        .health_versions
        .iter()
        .copied()
        .find(|v| info.supported_versions.iter().any(|s| s == v.service()));
    Ok((version, health))
}
