//! Keeps the answer to "why is my GPU pod Pending" on the pod (I/O shell over
//! `gpuplane_model::explain`; leader only). Reflector stores of pods (not Succeeded), nodes,
//! ResourceSlices, DeviceClasses, ResourceClaims and ResourceClaimTemplates feed one loop; any
//! change wakes it, and it recomputes at most once per `debounce`, so a reason is current
//! within about a second of the change that alters it.
//!
//! A cycle reads the stores' shared copies (no object is cloned) and reuses the device catalog
//! (a CEL evaluation per published device to build) until a ResourceSlice or DeviceClass
//! changes: at 1,000 nodes the cycle is then the classification itself.
//!
//! Per Pending, unscheduled pod that waits for a GPU: the condition [`CONDITION`] (False,
//! reason = the explanation's reason, message = its message), written only when it differs
//! from what the pod shows; one core/v1 Event per change of reason (Normal for `Quota` and
//! `Gang`, which the queue loop already reports, Warning otherwise); once scheduled, the
//! condition turns True (`Scheduled`). A pod the kubelet refused with TopologyAffinityError is
//! bound and Failed but never got its GPUs: it keeps the condition (reason `Topology`) and
//! counts as waiting while it exists. A failed write is logged and made again in the next cycle.

use super::metrics::QueueMetrics;
use super::pods::{self, PodRef};
use super::writes::{self, bounded, Condition};
use crate::quota::CatalogSettings;
use gpuplane_model::explain::{
    explain, fragmentation_by_pool, refused_by_kubelet, Cluster, Explanation, Reason, Shared,
};
use gpuplane_model::quota::DeviceCatalog;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Node, Pod, PodCondition};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::Notify;

/// The pod condition the explainer keeps (`gpuplane explain` reads it back).
pub use gpuplane_model::explain::GPUS_AVAILABLE as CONDITION;
/// The condition's reason once the pod is scheduled.
pub const SCHEDULED: &str = "Scheduled";

/// Tunables of the explainer.
#[derive(Debug, Clone)]
pub struct ExplainerOptions {
    pub catalog: CatalogSettings,
    /// This replica's name on Events.
    pub instance: String,
    /// The least time between two cycles: changes arriving meanwhile are handled together.
    pub debounce: Duration,
    /// A cycle runs at least this often, changes or not.
    pub resync: Duration,
    /// Writes in flight at most.
    pub concurrency: usize,
    /// A pod's condition is rewritten for a new message under the same reason (new free
    /// counts, say) at most this often; a new reason is written at once. In a large cluster
    /// every pod start changes every Capacity message, which would otherwise be a status write
    /// per Pending pod per cycle.
    pub message_refresh: Duration,
}

impl ExplainerOptions {
    pub fn new(catalog: CatalogSettings, instance: &str) -> ExplainerOptions {
        ExplainerOptions {
            catalog,
            instance: instance.into(),
            debounce: Duration::from_millis(500),
            resync: Duration::from_secs(60),
            concurrency: 8,
            message_refresh: Duration::from_secs(10),
        }
    }
}

/// The watch-fed inputs.
struct Stores {
    pods: Store<Pod>,
    nodes: Store<Node>,
    slices: Store<ResourceSlice>,
    classes: Store<DeviceClass>,
    claims: Store<ResourceClaim>,
    templates: Store<ResourceClaimTemplate>,
    /// Counts changes to slices and classes: the catalog is rebuilt when it moved.
    devices_changed: Arc<AtomicU64>,
}

impl Stores {
    /// Waits until every store was listed once (false: a writer went away).
    async fn ready(&self) -> bool {
        let (a, b, c, d, e, f) = tokio::join!(
            self.pods.wait_until_ready(),
            self.nodes.wait_until_ready(),
            self.slices.wait_until_ready(),
            self.classes.wait_until_ready(),
            self.claims.wait_until_ready(),
            self.templates.wait_until_ready(),
        );
        [a, b, c, d, e, f].iter().all(Result::is_ok)
    }

    /// The cluster as the stores hold it, with `pods` (the pod store's state, read once per
    /// cycle) and the catalog from `cache`, rebuilt only when slices or classes changed since.
    fn cluster(
        &self,
        pods: &[Arc<Pod>],
        settings: &CatalogSettings,
        cache: &mut Option<(u64, Arc<DeviceCatalog>)>,
    ) -> Cluster {
        // Read before the stores: a change landing during the build moves it again, so the
        // next cycle rebuilds.
        let generation = self.devices_changed.load(Ordering::Acquire);
        let catalog = match cache {
            Some((g, c)) if *g == generation => c.clone(),
            _ => {
                let (slices, classes) = (self.slices.state(), self.classes.state());
                let c = Arc::new(DeviceCatalog::from_shared(
                    &slices,
                    &classes,
                    settings.clone(),
                ));
                *cache = Some((generation, c.clone()));
                c
            }
        };
        let (nodes, slices, claims, templates) = (
            self.nodes.state(),
            self.slices.state(),
            self.claims.state(),
            self.templates.state(),
        );
        let shared = Shared {
            nodes: &nodes,
            pods,
            slices: &slices,
            claims: &claims,
            templates: &templates,
        };
        Cluster::from_shared(&shared, catalog)
    }
}

/// A reflector store of `api` and the future that feeds it, waking `wake` on every change and
/// counting it in `changes` when given.
fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    wake: Arc<Notify>,
    changes: Option<Arc<AtomicU64>>,
) -> (Store<K>, impl Future<Output = ()> + Send)
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
        if let Some(c) = &changes {
            c.fetch_add(1, Ordering::Release);
        }
        wake.notify_one();
    };
    crate::reflect::reflected(api, config, what, changed, |_| {})
}

/// What the explainer remembers of a pod it explains.
#[derive(Debug)]
struct Tracked {
    reason: Reason,
    created: SystemTime,
    /// The reason the last Event (ours, or a previous leader's condition) told.
    evented: Option<Reason>,
    /// When this explainer last decided to write the pod's condition.
    written: Option<std::time::Instant>,
}

/// One write a cycle decided on.
#[derive(Debug)]
enum Write {
    Condition {
        pod: PodRef,
        previous: Option<String>,
        available: bool,
        reason: String,
        message: String,
    },
    Event {
        pod: PodRef,
        reason: Reason,
        message: String,
    },
}

/// Our condition on `pod`, if it has one.
fn our_condition(pod: &Pod) -> Option<&PodCondition> {
    let conds = pod.status.as_ref()?.conditions.as_ref()?;
    conds.iter().find(|c| c.type_ == CONDITION)
}

/// The explainer's memory between cycles.
#[derive(Debug, Default)]
struct Explainer {
    tracked: HashMap<String, Tracked>,
    /// The device catalog and the slice/class change count it was built at.
    catalog: Option<(u64, Arc<DeviceCatalog>)>,
}

impl Explainer {
    /// The writes that bring every pod's condition and Events in step with `cluster`, and how
    /// many pods wait per reason. Pods that left the explained set are observed in `metrics`.
    fn plan(
        &mut self,
        pods: &[Arc<Pod>],
        cluster: &Cluster,
        metrics: &QueueMetrics,
        refresh: Duration,
    ) -> (Vec<Write>, BTreeMap<Reason, u64>) {
        let mut writes = Vec::new();
        let mut counts = BTreeMap::new();
        let mut seen = HashSet::new();
        for pod in pods {
            let cond = our_condition(pod);
            let previous = cond.map(|c| c.status.clone());
            let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
            // A pod the kubelet refused is bound but has no GPU: it is explained, not Scheduled.
            if let Some(node) = node.filter(|_| !refused_by_kubelet(pod)) {
                if previous.as_deref() == Some("False") {
                    writes.push(Write::Condition {
                        pod: PodRef::of(pod),
                        previous,
                        available: true,
                        reason: SCHEDULED.into(),
                        message: format!("scheduled to node {node}"),
                    });
                }
                continue;
            }
            let e = explain(pod, cluster);
            let Some(uid) = pod.metadata.uid.clone() else {
                continue;
            };
            if e.reason == Reason::NotWaiting {
                continue;
            }
            *counts.entry(e.reason).or_insert(0) += 1;
            writes.extend(self.waiting(pod, &uid, e, refresh));
            seen.insert(uid);
        }
        let now = SystemTime::now();
        self.tracked.retain(|uid, t| {
            let stays = seen.contains(uid);
            if !stays {
                let waited = now.duration_since(t.created).unwrap_or_default();
                metrics.left_pending(t.reason, waited);
            }
            stays
        });
        // Every condition before any Event: when a change flips many pods at once, the
        // conditions (what `kubectl get`, the CLI and tools read) land in half the time.
        writes.sort_by_key(|w| matches!(w, Write::Event { .. }));
        (writes, counts)
    }

    /// The writes for a pod that waits: its condition when the reason changed (or the message,
    /// once per `refresh`), and an Event when the reason is new to it.
    fn waiting(&mut self, pod: &Pod, uid: &str, e: Explanation, refresh: Duration) -> Vec<Write> {
        let cond = our_condition(pod);
        let previous = cond.map(|c| c.status.clone());
        let mut writes = Vec::new();
        // A previous leader's condition counts as told: a new leader does not repeat it.
        let told = cond
            .filter(|c| c.status == "False")
            .and_then(|c| c.reason.as_deref().and_then(Reason::parse));
        let t = self.tracked.entry(uid.to_string()).or_insert(Tracked {
            reason: e.reason,
            created: pods::created(pod),
            evented: told,
            written: None,
        });
        t.reason = e.reason;
        let same_reason = cond
            .is_some_and(|c| c.status == "False" && c.reason.as_deref() == Some(e.reason.as_str()));
        let same_message =
            same_reason && cond.and_then(|c| c.message.as_deref()) == Some(e.message.as_str());
        let refresh_due = t.written.is_none_or(|w| w.elapsed() >= refresh);
        if !same_reason || (!same_message && refresh_due) {
            t.written = Some(std::time::Instant::now());
            writes.push(Write::Condition {
                pod: PodRef::of(pod),
                previous: previous.clone(),
                available: false,
                reason: e.reason.as_str().into(),
                message: e.message.clone(),
            });
        }
        if t.evented != Some(e.reason) {
            writes.push(Write::Event {
                pod: PodRef::of(pod),
                reason: e.reason,
                message: e.message,
            });
        }
        writes
    }

    /// One cycle: plan, write, remember which Events went out. True when a write failed (the
    /// next cycle makes it again).
    async fn cycle(
        &mut self,
        client: &kube::Client,
        stores: &Stores,
        opts: &ExplainerOptions,
        metrics: &QueueMetrics,
    ) -> bool {
        let pods = stores.pods.state();
        let cluster = stores.cluster(&pods, &opts.catalog, &mut self.catalog);
        let (todo, counts) = self.plan(&pods, &cluster, metrics, opts.message_refresh);
        metrics.set_pending(&counts);
        metrics.set_pools(fragmentation_by_pool(&cluster.nodes));
        let client = client.clone();
        let instance = opts.instance.clone();
        let results = bounded(opts.concurrency, todo, |w| {
            let (client, instance) = (client.clone(), instance.clone());
            async move {
                let r = write(&client, &w, &instance).await;
                (w, r)
            }
        })
        .await;
        let mut failed = false;
        for (w, r) in results {
            let (pod, what) = match &w {
                Write::Condition { pod, .. } => (pod, "condition"),
                Write::Event { pod, .. } => (pod, "Event"),
            };
            match r {
                Ok(()) => {
                    if let Write::Event { pod, reason, .. } = &w {
                        if let Some(t) = self.tracked.get_mut(&pod.uid) {
                            t.evented = Some(*reason);
                        }
                    }
                }
                Err(e) => {
                    failed = true;
                    tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), error = %e, "writing the explainer's {what} failed; trying again next cycle");
                }
            }
        }
        failed
    }
}

/// Makes one write.
async fn write(client: &kube::Client, w: &Write, instance: &str) -> Result<(), kube::Error> {
    match w {
        Write::Condition {
            pod,
            previous,
            available,
            reason,
            message,
        } => {
            let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
            let c = Condition {
                type_: CONDITION,
                status: *available,
                reason,
                message,
            };
            writes::set_pod_condition(&api, &pod.name, previous.as_deref(), c).await
        }
        Write::Event {
            pod,
            reason,
            message,
        } => {
            let api: Api<CoreEvent> = Api::namespaced(client.clone(), &pod.namespace);
            let warning = !matches!(reason, Reason::Quota | Reason::Gang);
            writes::event(&api, pod, warning, reason.as_str(), message, instance).await
        }
    }
}

/// Runs the explainer until `stop`.
pub async fn run(
    client: kube::Client,
    opts: ExplainerOptions,
    metrics: Arc<QueueMetrics>,
    stop: impl Future<Output = ()>,
) {
    let wake = Arc::new(Notify::new());
    let c = || client.clone();
    let all = watcher::Config::default;
    // Succeeded pods never wait and, in a busy cluster, are most pods. Failed ones stay: the
    // kubelet ends a pod it refused for NUMA alignment Failed (the Topology reason).
    let live = all().fields("status.phase!=Succeeded");
    let devices_changed = Arc::new(AtomicU64::new(0));
    let dev = || Some(devices_changed.clone());
    let (pods, f1) = reflect(Api::<Pod>::all(c()), live, "pods", wake.clone(), None);
    let (nodes, f2) = reflect(Api::<Node>::all(c()), all(), "nodes", wake.clone(), None);
    let (slices, f3) = reflect(Api::all(c()), all(), "resourceslices", wake.clone(), dev());
    let (classes, f4) = reflect(Api::all(c()), all(), "deviceclasses", wake.clone(), dev());
    let (claims, f5) = reflect(Api::all(c()), all(), "resourceclaims", wake.clone(), None);
    let (templates, f6) = reflect(
        Api::all(c()),
        all(),
        "resourceclaimtemplates",
        wake.clone(),
        None,
    );
    let stores = Stores {
        pods,
        nodes,
        slices,
        classes,
        claims,
        templates,
        devices_changed,
    };
    let work = async {
        if !stores.ready().await {
            return;
        }
        let mut explainer = Explainer::default();
        loop {
            let failed = explainer.cycle(&client, &stores, &opts, &metrics).await;
            tokio::time::sleep(opts.debounce).await;
            if !failed {
                let _ = tokio::time::timeout(opts.resync, wake.notified()).await;
            }
        }
    };
    let feeds = async { tokio::join!(f1, f2, f3, f4, f5, f6) };
    tokio::select! {
        _ = stop => {}
        _ = work => {}
        _ = feeds => {}
    }
}
