//! One `gpuplane controller` replica: the admission webhook (served by every replica) and the
//! quota loops (run only while holding the Lease) side by side, so that `/readyz` reports the
//! elector's role and `/metrics` the loops' metrics next to the webhook's.

use crate::controller::{self, ControllerOptions};
use crate::controller_metrics::QueueMetrics;
use crate::elector::{ElectionError, Role};
use crate::webhook::{self, Loops, RunningWebhook, WebhookError, WebhookOptions};
use std::future::Future;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error(transparent)]
    Webhook(#[from] WebhookError),
    #[error(transparent)]
    Election(#[from] ElectionError),
}

/// A running replica.
pub struct Replica {
    webhook: RunningWebhook,
    stop: watch::Sender<bool>,
    loops: JoinHandle<()>,
}

impl Replica {
    pub fn webhook(&self) -> &RunningWebhook {
        &self.webhook
    }

    /// Stops the loops (releasing the Lease if held), then the webhook.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        if let Err(e) = self.loops.await {
            tracing::warn!(error = %e, "the quota loops' task failed");
        }
        self.webhook.stop().await;
    }
}

/// Starts the webhook (which fails with a clear message without API access), then the loops in
/// the background.
pub async fn start(
    client: kube::Client,
    mut webhook_opts: WebhookOptions,
    loops: ControllerOptions,
) -> Result<Replica, ReplicaError> {
    // Unusable timings are an error now, not a log line from a background task.
    loops.lease.validate().map_err(ElectionError::Timings)?;
    let (role_tx, role_rx) = watch::channel(Role::Follower(None));
    let metrics = Arc::new(QueueMetrics::default());
    webhook_opts.loops = Some(Loops {
        role: role_rx,
        metrics: metrics.clone(),
    });
    let running = webhook::start(client.clone(), webhook_opts).await?;
    // The loops read the webhook's copy of the published devices: one store and one catalog.
    let devices = Some(running.devices());
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        if let Err(e) =
            controller::run_reporting(client, loops, metrics, role_tx, devices, shutdown).await
        {
            tracing::error!(error = %e, "the quota loops stopped");
        }
    });
    Ok(Replica {
        webhook: running,
        stop,
        loops: task,
    })
}

/// Runs a replica until `shutdown` resolves.
pub async fn run(
    client: kube::Client,
    webhook_opts: WebhookOptions,
    loops: ControllerOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ReplicaError> {
    let replica = start(client, webhook_opts, loops).await?;
    shutdown.await;
    replica.stop().await;
    Ok(())
}
