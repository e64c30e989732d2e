//! `gpuplane explain`: answers from the controller's condition on the pod where it has one
//! (one GET), else reads what the pure explainer needs from the API server (the pod or the
//! namespace's pods, every node and pod bound to one, the namespace's unbound pods (its pod
//! groups' members), the ResourceSlices, DeviceClasses and
//! allocated claims, the namespace's ResourceClaimTemplates, and where Kueue runs its Workloads
//! and LocalQueues of the namespace) and renders its answers. One list
//! each per call, all at once, no cache: the CLI asks once and exits. At 1,000 nodes those
//! lists are megabytes, so the condition, current within about two seconds, is the default;
//! `live` computes anyway.

use gpuplane_model::explain::{explain, from_condition, refused_by_kubelet, Cluster, Listed};
/// What an answer is (its `-o json` form is documented in docs/troubleshooting.md).
pub use gpuplane_model::explain::{Explanation, Reason, Source};
use gpuplane_model::kueue::{KueueView, Workload};
use gpuplane_model::quota::CatalogSettings;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::ListParams;
use kube::Api;
use std::fmt::Write as _;

#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error(
        "{kind} {namespace}/{name} not found; check the name with `kubectl get {kind}s -n {namespace}`"
    )]
    NotFound {
        kind: &'static str,
        namespace: String,
        name: String,
    },
    #[error("reading {what} from the API server: {cause}")]
    Read { what: String, cause: kube::Error },
}

fn read(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ExplainError {
    let what = what.into();
    move |cause| ExplainError::Read { what, cause }
}

/// Every object `api` lists with `params`, or the error naming `what`.
async fn list<K>(api: Api<K>, params: &ListParams, what: &str) -> Result<Vec<K>, ExplainError>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api.list(params).await.map_err(read(what))?.items)
}

/// Kueue's Workloads and LocalQueues of `namespace` (none where Kueue is not installed).
async fn kueue(client: &kube::Client, namespace: &str) -> Result<KueueView, ExplainError> {
    crate::controller::kueue::list(client, namespace)
        .await
        .map_err(read(format!(
            "Kueue's Workloads and LocalQueues of namespace {namespace}"
        )))
}

/// What the explainer needs of the cluster, for pods of `namespace`; `kueue` as listed.
async fn cluster(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
    kueue: KueueView,
) -> Result<Cluster, ExplainError> {
    let all = ListParams::default();
    let bound = ListParams::default().fields("spec.nodeName!=");
    let c = || client.clone();
    let unbound = ListParams::default().fields("spec.nodeName=");
    let templates = format!("the ResourceClaimTemplates of namespace {namespace}");
    let unbound_what = format!("the unbound pods of namespace {namespace}");
    // All at once: the call takes as long as the largest list, not their sum.
    let (nodes, mut pods, unbound, slices, classes, claims, templates) = tokio::try_join!(
        list(Api::<Node>::all(c()), &all, "nodes"),
        list(Api::<Pod>::all(c()), &bound, "the pods bound to nodes"),
        list(
            Api::<Pod>::namespaced(c(), namespace),
            &unbound,
            &unbound_what
        ),
        list(Api::<ResourceSlice>::all(c()), &all, "ResourceSlices"),
        list(Api::<DeviceClass>::all(c()), &all, "DeviceClasses"),
        list(Api::<ResourceClaim>::all(c()), &all, "ResourceClaims"),
        list(
            Api::<ResourceClaimTemplate>::namespaced(c(), namespace),
            &all,
            &templates,
        ),
    )?;
    pods.extend(unbound);
    let listed = Listed {
        nodes,
        pods,
        slices,
        classes,
        claims,
        templates,
        kueue,
    };
    Ok(Cluster::new(&listed, settings))
}

/// The `kind` (`pod`, `job`) `namespace/name`, or the error naming it.
async fn get<K>(
    client: &kube::Client,
    kind: &'static str,
    namespace: &str,
    name: &str,
) -> Result<K, ExplainError>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    Api::<K>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(read(format!("{kind} {namespace}/{name}")))?
        .ok_or_else(|| ExplainError::NotFound {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        })
}

/// Why pod `namespace/name` is Pending: the controller's answer on the pod when it carries one
/// and `live` is false (one request), else computed from the cluster.
pub async fn pod(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
    name: &str,
    live: bool,
) -> Result<Explanation, ExplainError> {
    let pod: Pod = get(client, "pod", namespace, name).await?;
    if let Some(answer) = from_condition(&pod).filter(|_| !live) {
        return Ok(answer);
    }
    // Kueue's objects only for a pod Kueue holds.
    let view = match gpuplane_model::kueue::managed(&pod).is_some_and(|m| m.held) {
        true => kueue(client, namespace).await?,
        false => KueueView::default(),
    };
    let cluster = cluster(client, settings, namespace, view).await?;
    Ok(explain(&pod, &cluster))
}

/// Why each Pending pod of `namespace` is Pending, by name, and each pod the kubelet refused
/// for NUMA alignment (Failed, but it never had its GPUs). Unless `live`, a pod carrying the
/// controller's answer is answered from it; the cluster is read only when some pod carries none.
pub async fn namespace(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
    live: bool,
) -> Result<Vec<Explanation>, ExplainError> {
    let pending = ListParams::default().fields("status.phase!=Running,status.phase!=Succeeded");
    let what = format!("the Pending and Failed pods of namespace {namespace}");
    // Kueue's objects beside: a job Kueue holds has no pod to carry an answer.
    let (pods, view) = tokio::try_join!(
        list(
            Api::<Pod>::namespaced(client.clone(), namespace),
            &pending,
            &what
        ),
        kueue(client, namespace),
    )?;
    let waiting = |p: &&Pod| {
        refused_by_kubelet(p)
            || p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending")
    };
    let kept = |p: &Pod| from_condition(p).filter(|_| !live);
    let mut out = Vec::new();
    let mut to_compute = Vec::new();
    for p in pods.iter().filter(waiting) {
        match kept(p) {
            Some(answer) => out.push(answer),
            None => to_compute.push(p),
        }
    }
    out.extend(view.held_without_pods().map(|w| held(&view, w)));
    if !to_compute.is_empty() {
        let cluster = cluster(client, settings, namespace, view).await?;
        out.extend(to_compute.into_iter().map(|p| explain(p, &cluster)));
    }
    out.sort_by(|a, b| a.pod.cmp(&b.pod));
    Ok(out)
}

/// The answer for a workload Kueue holds before any of its pods exist, under its owner's name
/// (`job/train`).
fn held(kueue: &KueueView, w: &Workload) -> Explanation {
    Explanation {
        namespace: w.namespace.clone(),
        pod: w.owner_ref(),
        reason: Reason::Kueue,
        message: format!(
            "{} GPU pod{} not created yet; {}",
            w.gpu_pods,
            if w.gpu_pods == 1 { "" } else { "s" },
            kueue.held_message(w)
        ),
        source: Source::Computed,
    }
}

/// Why Job `namespace/name` waits: Kueue's answer while Kueue holds it (its pods do not exist
/// yet), else the answer for each of its Pending pods.
pub async fn job(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
    name: &str,
    live: bool,
) -> Result<Vec<Explanation>, ExplainError> {
    let job: Job = get(client, "job", namespace, name).await?;
    let view = kueue(client, namespace).await?;
    let uid = job.metadata.uid.as_deref().unwrap_or_default();
    if let Some(w) = view.owned_by(uid).filter(|w| w.held()) {
        return Ok(vec![held(&view, w)]);
    }
    let all = self::namespace(client, settings, namespace, live).await?;
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&format!("batch.kubernetes.io/controller-uid={uid}")))
        .await
        .map_err(read(format!("the pods of job {namespace}/{name}")))?;
    let mine: Vec<String> = pods
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let waiting: Vec<Explanation> = all.into_iter().filter(|a| mine.contains(&a.pod)).collect();
    if !waiting.is_empty() {
        return Ok(waiting);
    }
    let admitted = match view.owned_by(uid).and_then(|w| w.cluster_queue.as_deref()) {
        Some(cq) => format!("admitted by Kueue (ClusterQueue {cq}); "),
        None => String::new(),
    };
    Ok(vec![Explanation {
        namespace: namespace.into(),
        pod: format!("job/{name}"),
        reason: Reason::NotWaiting,
        message: format!("{admitted}none of its {} pods waits", mine.len()),
        source: Source::Computed,
    }])
}

/// A table with one row per answer: pod, reason, where it came from, message.
pub fn render_table(answers: &[Explanation]) -> String {
    let width = answers
        .iter()
        .map(|a| a.pod.len())
        .max()
        .unwrap_or(0)
        .max(3);
    let mut out = format!(
        "{:width$}  {:13}  {:10}  MESSAGE\n",
        "POD", "REASON", "SOURCE"
    );
    for a in answers {
        let source = match a.source {
            Source::Computed => "computed",
            Source::Controller { .. } => "controller",
        };
        let _ = writeln!(
            out,
            "{:width$}  {:13}  {source:10}  {}",
            a.pod,
            a.reason.as_str(),
            a.message
        );
    }
    out
}
