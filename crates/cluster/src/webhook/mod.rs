//! The admission webhook of `gpuplane controller`: GPU quota enforcement at Pod and
//! ResourceClaim creation, over HTTPS (hyper + rustls).
//!
//! - [`review`] (pure): AdmissionReview v1 decoding (kube's types, unknown fields ignored) and answers.
//! - [`tls`]: certificate and key from PEM files, reloaded when they change.
//! - [`cluster`]: watch-fed caches (GpuQuotas, ResourceSlices, DeviceClasses) and API reads.
//! - [`admit`]: the decisions, on top of [`crate::quota`]; [`commit`]: the group commit of
//!   reservations (one status write per batch of admissions to a quota); [`escrow`]: the
//!   replica's share of a quota's headroom, admitted within without a write.
//! - [`http`]: the servers (HTTPS webhook; plain-HTTP metrics and probes).
//! - [`health`]: what `/healthz` and `/readyz` say; [`metrics`]: what `/metrics` says.
//!
//! [`run`] serves until shutdown; [`start`] returns a handle (tests run several replicas
//! side by side).

pub mod admit;
pub mod cluster;
pub mod commit;
pub mod escrow;
pub mod health;
pub mod http;
pub mod metrics;
pub mod review;
pub mod tls;

use crate::controller_metrics::QueueMetrics;
use crate::elector::Role;
use crate::quota::CatalogSettings;
use commit::RetryBudget;
use gpuplane_model::report::chain;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Everything the webhook needs besides a client.
#[derive(Debug, Clone)]
pub struct WebhookOptions {
    /// Where to serve HTTPS (default `0.0.0.0:9443`).
    pub addr: SocketAddr,
    pub tls_cert_file: PathBuf,
    pub tls_key_file: PathBuf,
    /// Where to serve `/metrics`, `/healthz`, `/readyz` over plain HTTP.
    pub metrics_addr: Option<SocketAddr>,
    /// Users that may remove the Queue-mode scheduling gate (the controller's service
    /// account, `system:serviceaccount:<namespace>:gpuplane-controller`).
    pub controller_users: Vec<String>,
    /// Drivers and time-slicing the device catalog needs.
    pub catalog: CatalogSettings,
    /// How long to wait for API access and the first cache fill at start.
    pub sync_timeout: Duration,
    /// Conflict retries of one batch of reservations; its deadline (plus a second) bounds how
    /// long an admission waits for its answer.
    pub budget: RetryBudget,
    /// The most admissions to one quota decided and written together.
    pub max_batch: usize,
    /// This replica's name (on its escrows, with a per-webhook suffix).
    pub identity: String,
    /// Admit within a share of each Reject-mode quota's headroom held in its status (escrow)
    /// instead of one status write per batch of admissions.
    pub escrow: bool,
    /// How the API server is probed for `/readyz`.
    pub probes: health::ProbeSettings,
    /// The quota loops beside the webhook, if they run in this process.
    pub loops: Option<Loops>,
    /// Kueue runs in the cluster: its pods are its alone (see `admit`).
    pub kueue: bool,
}

/// The quota loops running beside the webhook (`gpuplane controller`): what `/readyz` and
/// `/metrics` report of them.
#[derive(Debug, Clone)]
pub struct Loops {
    /// This replica's part in leader election.
    pub role: watch::Receiver<Role>,
    pub metrics: Arc<QueueMetrics>,
}

impl WebhookOptions {
    /// Defaults for the controller running as service account `gpuplane-controller` in
    /// `namespace`.
    pub fn new(tls_cert_file: PathBuf, tls_key_file: PathBuf, namespace: &str) -> WebhookOptions {
        WebhookOptions {
            addr: SocketAddr::from(([0, 0, 0, 0], 9443)),
            tls_cert_file,
            tls_key_file,
            metrics_addr: None,
            controller_users: vec![format!(
                "system:serviceaccount:{namespace}:gpuplane-controller"
            )],
            catalog: CatalogSettings::default(),
            sync_timeout: Duration::from_secs(30),
            budget: RetryBudget {
                max_attempts: 200,
                // Well under the API server's 10 s webhook timeout.
                deadline: Duration::from_secs(4),
            },
            max_batch: commit::CommitOptions::default().max_batch,
            identity: crate::elector::identity("gpuplane-controller"),
            escrow: true,
            probes: health::ProbeSettings::default(),
            loops: None,
            kueue: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error(transparent)]
    Cluster(#[from] cluster::ClusterError),
    #[error("binding {addr}: {}", chain(.cause))]
    Bind {
        addr: SocketAddr,
        cause: std::io::Error,
    },
    #[error("loading the certificate: its job did not finish: {0}")]
    Worker(String),
}

/// A running webhook.
pub struct RunningWebhook {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    pub metrics: Arc<metrics::Metrics>,
    /// Batches, GpuQuota status writes and conflicts of the group commit.
    pub commits: Arc<commit::CommitCounters>,
    cluster: Arc<cluster::Cluster>,
}

impl RunningWebhook {
    /// The HTTPS address actually bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The published devices its caches hold, for the quota loops of the same replica.
    pub fn devices(&self) -> Arc<crate::published::Devices> {
        self.cluster.devices()
    }

    /// Stops accepting, lets open requests finish (up to 5 s), and returns.
    pub async fn stop(mut self) {
        self.stop.send_replace(true);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for RunningWebhook {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, WebhookError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| WebhookError::Bind {
            addr,
            cause: source,
        })
}

/// The serving certificate, read and parsed off the runtime.
async fn load_cert(opts: &WebhookOptions) -> Result<Arc<tls::ReloadingCert>, WebhookError> {
    let (cert_file, key_file) = (opts.tls_cert_file.clone(), opts.tls_key_file.clone());
    let cert = tokio::task::spawn_blocking(move || tls::ReloadingCert::new(&cert_file, &key_file))
        .await
        .map_err(|e| WebhookError::Worker(e.to_string()))??;
    Ok(Arc::new(cert))
}

/// Loads the certificate, checks API access and fills the caches, binds, and serves in the
/// background.
pub async fn start(
    client: kube::Client,
    opts: WebhookOptions,
) -> Result<RunningWebhook, WebhookError> {
    let cert = load_cert(&opts).await?;
    let tls = Arc::new(cert.server_config()?);
    let probes = Arc::new(health::Probes::new(
        opts.probes,
        opts.loops.as_ref().map(|l| l.role.clone()),
    ));
    let cluster = Arc::new(
        cluster::Cluster::start(
            client,
            opts.catalog.clone(),
            opts.sync_timeout,
            probes.clone(),
        )
        .await?,
    );
    let metrics = Arc::new(metrics::Metrics::default());
    let commit = commit::Committer::new(
        cluster.client().clone(),
        cluster.quota_store(),
        commit::CommitOptions {
            budget: opts.budget,
            max_batch: opts.max_batch,
            holder: escrow::holder_name(&opts.identity),
            escrow: opts.escrow,
        },
    );
    let admitter = Arc::new(admit::Admitter {
        cluster: cluster.clone(),
        commit: commit.clone(),
        opts: admit::AdmitOptions {
            controller_users: opts.controller_users.clone(),
            kueue: opts.kueue,
        },
        metrics: metrics.clone(),
    });
    let listener = bind(opts.addr).await?;
    let addr = listener.local_addr().map_err(|source| WebhookError::Bind {
        addr: opts.addr,
        cause: source,
    })?;
    let (stop, stopped) = watch::channel(false);
    // Bound: connections wait in the backlog until the accept loop takes them.
    probes.set_serving(true);
    let mut tasks = vec![tokio::spawn(http::serve_tls(
        listener,
        tls,
        admitter,
        probes.clone(),
        stopped.clone(),
    ))];
    let mut metrics_addr = None;
    if let Some(m) = opts.metrics_addr {
        let l = bind(m).await?;
        metrics_addr = l.local_addr().ok();
        let reporter = Arc::new(http::Reporter {
            metrics: metrics.clone(),
            cluster: cluster.clone(),
            probes: probes.clone(),
            commits: commit.counters.clone(),
            loops: opts.loops.as_ref().map(|l| l.metrics.clone()),
        });
        tasks.push(tokio::spawn(http::serve_metrics(l, reporter, stopped)));
    }
    tracing::info!(%addr, metrics = ?metrics_addr, "admission webhook serving");
    Ok(RunningWebhook {
        addr,
        metrics_addr,
        stop,
        tasks,
        metrics,
        commits: commit.counters.clone(),
        cluster,
    })
}

/// Serves until `shutdown` resolves.
pub async fn run(
    client: kube::Client,
    opts: WebhookOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), WebhookError> {
    let running = start(client, opts).await?;
    shutdown.await;
    running.stop().await;
    Ok(())
}
