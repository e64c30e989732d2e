//! What the webhook knows of the cluster (I/O shell): a watch-fed cache of GpuQuotas, the
//! published devices ([`Devices`], which the quota loops share), and direct reads of
//! ResourceClaimTemplates.
//!
//! The caches keep their last state while the API server is away, so the webhook keeps
//! answering: pods in namespaces without a GpuQuota, and pods that need no GPU, are admitted
//! from the cache; a reservation needs a fresh read and a write, and is denied (fail closed)
//! when those fail. A probe loop tells [`Probes`] whether the API server answers (a watch
//! that fails to reconnect yields nothing, so the caches alone cannot tell).

use super::health::Probes;
use crate::published::Devices;
use crate::quota::{CatalogSettings, DeviceCatalog, GpuQuota};
use gpuplane_model::report::chain;
use k8s_openapi::api::resource::v1::{ResourceClaimSpec, ResourceClaimTemplate};
use kube::api::{Api, ListParams, WatchParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(
        "cannot list GpuQuotas (quota.gpuplane.dev/v1alpha1) from the API server: {}. Is the API \
         server reachable, is the CRD installed (daemonset/controller/crd.yaml), and may this \
         service account list gpuquotas (daemonset/controller/rbac.yaml)?",
        chain(.0)
    )]
    Probe(kube::Error),
    #[error("the API server did not answer the first GpuQuota list within {0:?}")]
    ProbeTimeout(Duration),
    #[error("the caches of {0} did not fill within {1:?}: is the API server reachable and may this service account list and watch them?")]
    Sync(&'static str, Duration),
}

/// Caches and API access for admission.
pub struct Cluster {
    client: kube::Client,
    quotas: Store<GpuQuota>,
    devices: Arc<Devices>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn spawn_reflector(api: Api<GpuQuota>, probes: Arc<Probes>) -> (Store<GpuQuota>, JoinHandle<()>) {
    let what = "gpuquotas";
    let failed = move |e: &watcher::Error| probes.watch_failed(what, e.to_string());
    let (reader, feed) =
        crate::reflect::reflected(api, watcher::Config::default(), what, || {}, failed);
    (reader, tokio::spawn(feed))
}

/// One probe: a GpuQuota list, then a watch opened from it (proving the caches' watches can
/// reconnect, not only that lists work), dropped at once.
async fn probe(api: &Api<GpuQuota>) -> Result<(), kube::Error> {
    let list = api.list(&ListParams::default().limit(1)).await?;
    let rv = list.metadata.resource_version.unwrap_or_default();
    drop(api.watch(&WatchParams::default().timeout(1), &rv).await?);
    Ok(())
}

/// Probes the API server every interval until aborted; the heartbeat shows the loop turns.
async fn probe_loop(api: Api<GpuQuota>, probes: Arc<Probes>) {
    let s = probes.settings();
    loop {
        probes.heartbeat();
        tokio::time::sleep(s.interval).await;
        match tokio::time::timeout(s.stale_after, probe(&api)).await {
            Ok(Ok(())) => probes.api_ok(),
            Ok(Err(e)) => probes.api_failed(e.to_string()),
            Err(_) => probes.api_failed(format!("no answer within {:?}", s.stale_after)),
        }
    }
}

impl Cluster {
    /// Probes API access (a clear error when there is none), starts the watches and the probe
    /// loop, and waits up to `sync_timeout` for the caches to fill.
    pub async fn start(
        client: kube::Client,
        settings: CatalogSettings,
        sync_timeout: Duration,
        probes: Arc<Probes>,
    ) -> Result<Cluster, ClusterError> {
        let all: Api<GpuQuota> = Api::all(client.clone());
        match tokio::time::timeout(sync_timeout, all.list(&ListParams::default().limit(1))).await {
            Err(_) => return Err(ClusterError::ProbeTimeout(sync_timeout)),
            Ok(Err(e)) => return Err(ClusterError::Probe(e)),
            Ok(Ok(_)) => probes.api_ok(),
        }
        let (quotas, t1) = spawn_reflector(all.clone(), probes.clone());
        let watching = probes.clone();
        let devices = Devices::start(&client, settings, move |what, e: &watcher::Error| {
            watching.watch_failed(what, e.to_string())
        });
        let t2 = tokio::spawn(probe_loop(all, probes));
        let cluster = Cluster {
            client,
            quotas,
            devices,
            tasks: vec![t1, t2],
        };
        match tokio::time::timeout(sync_timeout, cluster.quotas.wait_until_ready()).await {
            Ok(Ok(())) => {}
            _ => return Err(ClusterError::Sync("gpuquotas", sync_timeout)),
        }
        match tokio::time::timeout(sync_timeout, cluster.devices.ready()).await {
            Ok(Ok(())) => {}
            Ok(Err(what)) => return Err(ClusterError::Sync(what, sync_timeout)),
            Err(_) => {
                return Err(ClusterError::Sync(
                    "resourceslices and deviceclasses",
                    sync_timeout,
                ))
            }
        }
        Ok(cluster)
    }

    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// GpuQuotas of `namespace` (cached), sorted by name.
    pub fn quotas_in(&self, namespace: &str) -> Vec<Arc<GpuQuota>> {
        let mut q = self
            .quotas
            .state_filter(|q| q.metadata.namespace.as_deref() == Some(namespace));
        q.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        q
    }

    /// Every GpuQuota (cached), as last seen.
    pub fn cached_quotas(&self) -> Vec<Arc<GpuQuota>> {
        self.quotas.state()
    }

    /// Every GpuQuota (cached): the cohort peers.
    pub fn all_quotas(&self) -> Vec<GpuQuota> {
        self.quotas.state().iter().map(|q| (**q).clone()).collect()
    }

    /// The device catalog of the cached slices and classes, rebuilt when they changed.
    pub fn catalog(&self) -> Arc<DeviceCatalog> {
        self.devices.catalog()
    }

    /// The published devices, shared with the quota loops of the same replica.
    pub fn devices(&self) -> Arc<Devices> {
        self.devices.clone()
    }

    /// A ResourceClaimTemplate's claim spec, read from the API server; `Ok(None)` when it
    /// does not exist.
    pub async fn template(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ResourceClaimSpec>, kube::Error> {
        let api: Api<ResourceClaimTemplate> = Api::namespaced(self.client.clone(), namespace);
        Ok(api.get_opt(name).await?.map(|t| t.spec.spec))
    }

    pub fn quota_api(&self, namespace: &str) -> Api<GpuQuota> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// The GpuQuota cache (the group commit takes cohort peers from it).
    pub fn quota_store(&self) -> Store<GpuQuota> {
        self.quotas.clone()
    }
}
