//! The quota loop's watchers: one per resource the loop reads (governed pods slimmed down,
//! GpuQuotas, ResourceClaims, templates), each feeding the loop's channel as an [`Input`],
//! and a relay of the shared [`Devices`]' changes. The labeler's watcher uses [`forward`] too.

use crate::published::Devices;
use crate::quota::{governs_pod, GpuQuota};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;

/// One change seen by a watcher (boxed: pods are large).
#[derive(Debug)]
pub enum Input {
    Pod(Box<Event<Pod>>),
    Quota(Box<Event<GpuQuota>>),
    Claim(Box<Event<ResourceClaim>>),
    Template(Box<Event<ResourceClaimTemplate>>),
    /// A ResourceSlice or DeviceClass changed (the catalog is read from [`Devices`]).
    Devices,
}

/// Watches `api` with `config` in a task, feeding `tx` until the receiver goes away; `wrap`
/// turns an event into the loop's input, or `None` for one the loop does not need. Shared with
/// [`super::labeler`].
pub(super) fn forward<K, T, F>(
    api: Api<K>,
    config: watcher::Config,
    tx: mpsc::Sender<T>,
    wrap: F,
) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
    T: Send + 'static,
    F: Fn(Event<K>) -> Option<T> + Send + 'static,
{
    tokio::spawn(async move {
        let stream = watcher::watcher(api, config).default_backoff();
        tokio::pin!(stream);
        while let Some(item) = stream.next().await {
            match item {
                Ok(ev) => {
                    let Some(input) = wrap(ev) else { continue };
                    if tx.send(input).await.is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "watch failed; retrying with backoff"),
            }
        }
    })
}

/// Watches every resource the loop reads, feeding `tx` until the receiver goes away.
pub fn spawn_watchers(
    client: &kube::Client,
    devices: &Devices,
    tx: mpsc::Sender<Input>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut changes = devices.changes();
    let relay = tx.clone();
    vec![
        tokio::spawn(async move {
            while changes.changed().await.is_ok() {
                if relay.send(Input::Devices).await.is_err() {
                    return;
                }
            }
        }),
        // Only pods the quota governs are cached: a cluster's many pods without GPUs cost the
        // controller nothing but their decoding (the rule is immutable per pod, so a dropped
        // pod never needs a delete).
        forward(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().page_size(crate::reflect::LIST_PAGE),
            tx.clone(),
            |e| {
                let governed = match &e {
                    Event::Apply(p) | Event::InitApply(p) | Event::Delete(p) => governs_pod(p),
                    Event::Init | Event::InitDone => true,
                };
                governed.then(|| Input::Pod(Box::new(e.modify(slim_pod))))
            },
        ),
        forward(
            Api::<GpuQuota>::all(client.clone()),
            watcher::Config::default(),
            tx.clone(),
            |e| Some(Input::Quota(Box::new(e))),
        ),
        forward(
            Api::<ResourceClaim>::all(client.clone()),
            watcher::Config::default(),
            tx.clone(),
            |e| Some(Input::Claim(Box::new(e))),
        ),
        forward(
            Api::<ResourceClaimTemplate>::all(client.clone()),
            watcher::Config::default(),
            tx,
            |e| Some(Input::Template(Box::new(e))),
        ),
    ]
}

/// Drops what the loops never read of a pod they keep: managed fields, annotations other than
/// ours, container env, commands, probes and volumes (pods are large; the caches keep many).
/// The explainer's store slims its pods with it too.
pub(super) fn slim_pod(p: &mut Pod) {
    p.metadata.managed_fields = None;
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.retain(|k, _| k.starts_with("quota.gpuplane.dev/"));
    }
    if let Some(spec) = p.spec.as_mut() {
        spec.volumes = None;
        for c in spec
            .containers
            .iter_mut()
            .chain(spec.init_containers.iter_mut().flatten())
        {
            c.env = None;
            c.env_from = None;
            c.command = None;
            c.args = None;
            c.liveness_probe = None;
            c.readiness_probe = None;
            c.startup_probe = None;
            c.volume_mounts = None;
        }
    }
}
