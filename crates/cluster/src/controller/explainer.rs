//! Keeps the answer to "why is my GPU pod Pending" on the pod (I/O shell over
//! `gpuplane_model::explain`; leader only). Reflector stores of the pods that ask for devices
//! (not Succeeded, slimmed), nodes, ResourceClaims and ResourceClaimTemplates, and the shared
//! published [`Devices`], feed one loop; any change wakes it, and it recomputes at most once
//! per `debounce`, so a reason is current within about a second of the change that alters it.
//!
//! A cycle reads the stores' shared copies (no object is cloned) and the shared device catalog
//! (rebuilt only when a ResourceSlice or DeviceClass changes): at 1,000 nodes the cycle is
//! then the classification itself.
//!
//! Per Pending, unscheduled pod that waits for a GPU: the condition [`CONDITION`] (False,
//! reason = the explanation's reason, message = its message), written only when it differs
//! from what the pod shows; one core/v1 Event per change of reason (Normal for `Quota` and
//! `Gang`, which the queue loop already reports, Warning otherwise); once scheduled, the
//! condition turns True (`Scheduled`). A pod the kubelet refused with TopologyAffinityError is
//! bound and Failed but never got its GPUs: it keeps the condition (reason `Topology`) and
//! counts as waiting while it exists. A failed write is logged and made again in the next cycle.
//!
//! New reasons are written first; Events and message-only rewrites follow a few batches at a
//! time, and a change arriving meanwhile stops them until the next cycle (which plans them
//! again), so after a change that flips thousands of pods the next change's reasons do not wait
//! behind its Events. Cycles are at least as far apart as one classification takes: at
//! 1,000 nodes and 5,000 Pending pods that is the CPU the explainer may use, at most half a core.

use super::kueue::{LocalQueue, Workload};
use super::pods::{self, PodRef};
use super::writes::{self, bounded, Condition};
use crate::controller_metrics::QueueMetrics;
use crate::published::Devices;
use crate::reflect::{Cached, Shape};
use gpuplane_model::explain::{
    explain, fragmentation_by_pool, refused_by_kubelet, Cluster, Explanation, Reason, Shared,
};
use k8s_openapi::api::core::v1::{Event as CoreEvent, Node, Pod, PodCondition};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::Notify;

/// The pod condition the explainer keeps (`gpuplane explain` reads it back).
pub use gpuplane_model::explain::GPUS_AVAILABLE as CONDITION;
/// The condition's reason once the pod is scheduled.
pub const SCHEDULED: &str = "Scheduled";

/// Tunables of the explainer.
#[derive(Debug, Clone)]
pub struct ExplainerOptions {
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
    /// Kueue runs in the cluster: its Workloads and LocalQueues are watched, so a pod it holds
    /// is answered with Kueue's words and a suspended job's pods count as waiting.
    pub kueue: bool,
}

impl ExplainerOptions {
    pub fn new(instance: &str) -> ExplainerOptions {
        ExplainerOptions {
            instance: instance.into(),
            debounce: Duration::from_millis(500),
            resync: Duration::from_secs(60),
            concurrency: 32,
            message_refresh: Duration::from_secs(10),
            kueue: false,
        }
    }
}

/// The watch-fed inputs.
struct Stores {
    pods: Store<Pod>,
    nodes: Store<Node>,
    devices: Arc<Devices>,
    claims: Store<ResourceClaim>,
    templates: Store<ResourceClaimTemplate>,
    /// Kueue's Workloads and LocalQueues, where it runs; not waited for (an answer without
    /// Kueue's message is still an answer).
    kueue: Option<(Store<Workload>, Store<LocalQueue>)>,
    /// Counts changes to any of them: pending writes stop for a new plan when it moved.
    changes: Arc<AtomicU64>,
}

impl Stores {
    /// Waits until every store was listed once (false: a writer went away).
    async fn ready(&self) -> bool {
        let (a, b, c, d, e) = tokio::join!(
            self.pods.wait_until_ready(),
            self.nodes.wait_until_ready(),
            self.devices.ready(),
            self.claims.wait_until_ready(),
            self.templates.wait_until_ready(),
        );
        c.is_ok() && [a, b, d, e].iter().all(Result::is_ok)
    }

    /// The cluster as the stores hold it, with `pods` (the pod store's state, read once per
    /// cycle).
    fn cluster(&self, pods: &[Arc<Pod>]) -> Cluster {
        let catalog = self.devices.catalog();
        let (nodes, claims, templates) = (
            self.nodes.state(),
            self.claims.state(),
            self.templates.state(),
        );
        let shared = Shared {
            nodes: &nodes,
            pods,
            claims: &claims,
            templates: &templates,
        };
        let mut cluster = Cluster::from_shared(&shared, catalog);
        if let Some((w, q)) = &self.kueue {
            cluster.kueue = super::kueue::view(&w.state(), &q.state());
        }
        cluster
    }
}

/// A reflector store of `api` (of what `shape` keeps) and the future that feeds it, waking
/// `wake` and counting in `changes` on every change.
fn reflect<K: Cached>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    shape: Shape<K>,
    (wake, changes): (Arc<Notify>, Arc<AtomicU64>),
) -> (Store<K>, impl Future<Output = ()> + Send) {
    let changed = move || changed(&wake, &changes);
    crate::reflect::reflected_shaped(api, config, what, shape, changed, |_| {})
}

/// Tells the loop of a change.
fn changed(wake: &Notify, changes: &AtomicU64) {
    changes.fetch_add(1, Ordering::Release);
    wake.notify_one();
}

/// Whether `pod` asks for any extended resource or claim: the only pods that wait for a GPU or
/// hold one. Wider than the quota's rule (`governs_pod`): an extended resource backed by a
/// DeviceClass may have any name, and a class may appear later. Pods' resource names and
/// claims never change, so the answer holds for a pod's life.
fn asks_for_devices(pod: &Pod) -> bool {
    crate::quota::claims_or_names(pod, |k| k.contains('/'))
}

/// What the explainer remembers of a pod it explains.
#[derive(Debug)]
struct Tracked {
    reason: Reason,
    created: SystemTime,
    /// The reason the last Event (ours, or a previous leader's condition) told.
    evented: Option<Reason>,
    /// When this explainer last wrote the pod's condition.
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
        /// A new reason (or status), not only a new message.
        urgent: bool,
    },
    Event {
        pod: PodRef,
        reason: Reason,
        message: String,
    },
}

impl Write {
    /// Whether a cycle may leave it to the next one.
    fn deferrable(&self) -> bool {
        !matches!(self, Write::Condition { urgent: true, .. })
    }
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
    /// The earliest end of a message window that held back a pod's newer numbers: the loop
    /// wakes then to write them, changes or not.
    held_back_until: Option<Instant>,
}

impl Explainer {
    /// How long the loop may wait for a change: `resync` at most, and no later than the end of
    /// a message window that held back a pod's newer numbers, which are written then.
    fn idle(&self, resync: Duration) -> Duration {
        self.held_back_until.map_or(resync, |end| {
            end.saturating_duration_since(Instant::now()).min(resync)
        })
    }

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
        self.held_back_until = None;
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
                        urgent: true,
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
        // New reasons first (what `kubectl get`, the CLI and tools read), then Events, then
        // new numbers under an unchanged reason.
        writes.sort_by_key(|w| match w {
            Write::Condition { urgent: true, .. } => 0,
            Write::Event { .. } => 1,
            Write::Condition { .. } => 2,
        });
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
        let window_end = t.written.map(|w| w + refresh);
        let refresh_due = window_end.is_none_or(|end| Instant::now() >= end);
        let held_back = window_end.filter(|_| same_reason && !same_message && !refresh_due);
        if !same_reason || (!same_message && refresh_due) {
            writes.push(Write::Condition {
                pod: PodRef::of(pod),
                previous: previous.clone(),
                available: false,
                reason: e.reason.as_str().into(),
                message: e.message.clone(),
                urgent: !same_reason,
            });
        }
        if t.evented != Some(e.reason) {
            writes.push(Write::Event {
                pod: PodRef::of(pod),
                reason: e.reason,
                message: e.message,
            });
        }
        if let Some(end) = held_back {
            self.held_back_until = Some(self.held_back_until.map_or(end, |h| h.min(end)));
        }
        writes
    }

    /// One cycle: plan, write every new reason, then the Events and new numbers a batch at a
    /// time until done or until the stores changed (the next cycle plans the rest again).
    /// Returns whether a write failed, and how long the plan took.
    async fn cycle(
        &mut self,
        client: &kube::Client,
        stores: &Stores,
        opts: &ExplainerOptions,
        metrics: &QueueMetrics,
    ) -> (bool, Duration) {
        let (seen, began) = (stores.changes.load(Ordering::Acquire), Instant::now());
        let (todo, counts) = {
            let pods = stores.pods.state();
            let cluster = stores.cluster(&pods);
            metrics.set_pools(fragmentation_by_pool(&cluster.nodes));
            let (todo, mut counts) = self.plan(&pods, &cluster, metrics, opts.message_refresh);
            // A suspended job's pods wait too, though only its Workload shows it.
            let held: u64 = cluster.kueue.held_without_pods().map(|w| w.gpu_pods).sum();
            if held > 0 {
                *counts.entry(Reason::Kueue).or_insert(0) += held;
            }
            (todo, counts)
        };
        let planned = began.elapsed();
        metrics.set_pending(&counts);
        let (urgent, later): (Vec<_>, Vec<_>) = todo.into_iter().partition(|w| !w.deferrable());
        let mut failed = self.send(client, opts, urgent).await;
        let mut later = later.into_iter();
        loop {
            let batch: Vec<_> = later.by_ref().take(opts.concurrency * 4).collect();
            if batch.is_empty() || stores.changes.load(Ordering::Acquire) != seen {
                break;
            }
            failed |= self.send(client, opts, batch).await;
        }
        (failed, planned)
    }

    /// Makes `todo`'s writes, `opts.concurrency` at a time, and remembers what went out; true
    /// when one failed.
    async fn send(
        &mut self,
        client: &kube::Client,
        opts: &ExplainerOptions,
        todo: Vec<Write>,
    ) -> bool {
        let now = Instant::now();
        for w in &todo {
            if let Write::Condition { pod, .. } = w {
                if let Some(t) = self.tracked.get_mut(&pod.uid) {
                    t.written = Some(now);
                }
            }
        }
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
            ..
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

/// Cycles once the stores have listed, then again on each change (and at the end of a held-back
/// message window, and at resync); never returns while they have.
async fn explain_each_change(
    client: &kube::Client,
    stores: &Stores,
    opts: &ExplainerOptions,
    metrics: &QueueMetrics,
    wake: &Notify,
) {
    if !stores.ready().await {
        return;
    }
    let mut explainer = Explainer::default();
    loop {
        let (failed, planned) = explainer.cycle(client, stores, opts, metrics).await;
        // A plan costs CPU in proportion to the cluster: at most half the loop's time.
        tokio::time::sleep(opts.debounce.max(planned)).await;
        if !failed {
            let idle = explainer.idle(opts.resync);
            let _ = tokio::time::timeout(idle, wake.notified()).await;
        }
    }
}

/// Runs the explainer until `stop`.
pub async fn run(
    client: kube::Client,
    opts: ExplainerOptions,
    devices: Arc<Devices>,
    metrics: Arc<QueueMetrics>,
    stop: impl Future<Output = ()>,
) {
    let wake = Arc::new(Notify::new());
    let c = || client.clone();
    let all = watcher::Config::default;
    // Succeeded pods never wait and, in a busy cluster, are most pods. Failed ones stay: the
    // kubelet ends a pod it refused for NUMA alignment Failed (the Topology reason).
    let live = all()
        .fields("status.phase!=Succeeded")
        .page_size(crate::reflect::LIST_PAGE);
    // Pods that ask for no device never wait for one nor hold one: in a busy cluster they are
    // most pods, and the store would keep them whole.
    let gpu_pods = Shape {
        keep: asks_for_devices,
        slim: super::watchers::slim_pod,
    };
    let changes = Arc::new(AtomicU64::new(0));
    let tell = || (wake.clone(), changes.clone());
    let (pods, f1) = reflect(Api::all(c()), live, "pods", gpu_pods, tell());
    let (nodes, f2) = reflect(
        Api::<Node>::all(c()),
        all(),
        "nodes",
        Shape::whole(),
        tell(),
    );
    let (claims, f3) = reflect(
        Api::all(c()),
        all(),
        "resourceclaims",
        Shape::whole(),
        tell(),
    );
    let (templates, f4) = reflect(
        Api::all(c()),
        all(),
        "resourceclaimtemplates",
        Shape::whole(),
        tell(),
    );
    let (kueue, f5): (_, std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) = if opts.kueue {
        let (w, fw) = reflect(Api::all(c()), all(), "workloads", Shape::whole(), tell());
        let (q, fq) = reflect(Api::all(c()), all(), "localqueues", Shape::whole(), tell());
        let feed = async move {
            tokio::join!(fw, fq);
        };
        (Some((w, q)), Box::pin(feed))
    } else {
        (None, Box::pin(std::future::pending()))
    };
    let mut published = devices.changes();
    let relay = async {
        while published.changed().await.is_ok() {
            changed(&wake, &changes);
        }
    };
    let stores = Stores {
        pods,
        nodes,
        devices,
        claims,
        templates,
        kueue,
        changes: changes.clone(),
    };
    let work = explain_each_change(&client, &stores, &opts, &metrics, &wake);
    let feeds = async { tokio::join!(f1, f2, f3, f4, f5, relay) };
    tokio::select! {
        _ = stop => {}
        _ = work => {}
        _ = feeds => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    }

    fn limits(l: serde_json::Value) -> serde_json::Value {
        json!({"containers": [{"name": "c", "resources": {"limits": l}}]})
    }

    #[test]
    fn only_pods_asking_for_a_device_are_kept() {
        assert!(asks_for_devices(&pod(limits(
            json!({"nvidia.com/gpu": "1"})
        ))));
        // An extended resource a DeviceClass may back, under any name.
        assert!(asks_for_devices(&pod(limits(
            json!({"example.com/accel": "1"})
        ))));
        let claim = json!({"resourceClaims": [{"name": "g", "resourceClaimTemplateName": "t"}],
            "containers": [{"name": "c"}]});
        assert!(asks_for_devices(&pod(claim)));
        let init = json!({"initContainers": [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": "1"}}}],
            "containers": [{"name": "c"}]});
        assert!(asks_for_devices(&pod(init)));
        assert!(!asks_for_devices(&pod(limits(
            json!({"cpu": "2", "memory": "1Gi", "hugepages-2Mi": "1Gi"})
        ))));
        assert!(!asks_for_devices(&pod(
            json!({"containers": [{"name": "c"}]})
        )));
    }
}
