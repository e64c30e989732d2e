//! What the webhook knows of the cluster (I/O shell): watch-fed caches of GpuQuotas,
//! ResourceSlices and DeviceClasses, and direct reads of ResourceClaimTemplates.
//!
//! The caches keep their last state while the API server is away, so the webhook keeps
//! answering: pods in namespaces without a GpuQuota, and pods that need no GPU, are admitted
//! from the cache; a reservation needs a fresh read and a write, and is denied (fail closed)
//! when those fail. A probe loop tells [`Probes`] whether the API server answers (a watch
//! that fails to reconnect yields nothing, so the caches alone cannot tell).

use super::probe::Probes;
use crate::quota::{CatalogSettings, DeviceCatalog, GpuQuota};
use gpuplane_model::report::chain;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaimSpec, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{Api, ListParams, WatchParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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
    slices: Store<ResourceSlice>,
    classes: Store<DeviceClass>,
    /// Bumped on every slice or class event; the catalog is rebuilt when it moved.
    generation: Arc<AtomicU64>,
    settings: CatalogSettings,
    catalog: Mutex<Option<(u64, Arc<DeviceCatalog>)>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn spawn_reflector<K>(
    api: Api<K>,
    generation: Option<Arc<AtomicU64>>,
    what: &'static str,
    probes: Arc<Probes>,
) -> (Store<K>, JoinHandle<()>)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let changed = move || {
        if let Some(g) = &generation {
            g.fetch_add(1, Ordering::Relaxed);
        }
    };
    let failed = move |e: &watcher::Error| probes.watch_failed(what, e.to_string());
    let (reader, feed) =
        crate::reflect::reflected(api, watcher::Config::default(), what, changed, failed);
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
        let generation = Arc::new(AtomicU64::new(0));
        let (quotas, t1) = spawn_reflector(all.clone(), None, "gpuquotas", probes.clone());
        let (slices, t2) = spawn_reflector(
            Api::<ResourceSlice>::all(client.clone()),
            Some(generation.clone()),
            "resourceslices",
            probes.clone(),
        );
        let (classes, t3) = spawn_reflector(
            Api::<DeviceClass>::all(client.clone()),
            Some(generation.clone()),
            "deviceclasses",
            probes.clone(),
        );
        let t4 = tokio::spawn(probe_loop(all, probes));
        let cluster = Cluster {
            client,
            quotas,
            slices,
            classes,
            generation,
            settings,
            catalog: Mutex::new(None),
            tasks: vec![t1, t2, t3, t4],
        };
        for (what, ready) in [
            (
                "gpuquotas",
                tokio::time::timeout(sync_timeout, cluster.quotas.wait_until_ready()).await,
            ),
            (
                "resourceslices",
                tokio::time::timeout(sync_timeout, cluster.slices.wait_until_ready()).await,
            ),
            (
                "deviceclasses",
                tokio::time::timeout(sync_timeout, cluster.classes.wait_until_ready()).await,
            ),
        ] {
            if !matches!(ready, Ok(Ok(()))) {
                return Err(ClusterError::Sync(what, sync_timeout));
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
        let g = self.generation.load(Ordering::Relaxed);
        let mut cache = lock(&self.catalog);
        if let Some((cg, c)) = cache.as_ref() {
            if *cg == g {
                return c.clone();
            }
        }
        let (slices, classes) = (self.slices.state(), self.classes.state());
        let c = Arc::new(DeviceCatalog::from_shared(
            &slices,
            &classes,
            self.settings.clone(),
        ));
        *cache = Some((g, c.clone()));
        c
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
