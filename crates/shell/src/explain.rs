//! `gpuplane explain`: reads what the pure explainer needs from the API server (the pod or the
//! namespace's pods, every node and pod bound to one, the namespace's unbound pods (its pod
//! groups' members), the ResourceSlices, DeviceClasses and
//! allocated claims, the namespace's ResourceClaimTemplates) and renders its answers. One list
//! each per call, all at once, no cache: the CLI asks once and exits.

use gpuplane_model::explain::{explain, refused_by_kubelet, Cluster, Explanation, Listed};
use gpuplane_model::quota::CatalogSettings;
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
        "pod {namespace}/{name} not found; check the name with `kubectl get pods -n {namespace}`"
    )]
    NoPod { namespace: String, name: String },
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

/// What the explainer needs of the cluster, for pods of `namespace`.
async fn cluster(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
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
    };
    Ok(Cluster::new(&listed, settings))
}

/// Why pod `namespace/name` is Pending.
pub async fn pod(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
    name: &str,
) -> Result<Explanation, ExplainError> {
    let api = Api::<Pod>::namespaced(client.clone(), namespace);
    let get = async {
        api.get_opt(name)
            .await
            .map_err(read(format!("pod {namespace}/{name}")))?
            .ok_or_else(|| ExplainError::NoPod {
                namespace: namespace.into(),
                name: name.into(),
            })
    };
    let (pod, cluster) = tokio::try_join!(get, cluster(client, settings, namespace))?;
    Ok(explain(&pod, &cluster))
}

/// Why each Pending pod of `namespace` is Pending, by name, and each pod the kubelet refused
/// for NUMA alignment (Failed, but it never had its GPUs).
pub async fn namespace(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
) -> Result<Vec<Explanation>, ExplainError> {
    let pending = ListParams::default().fields("status.phase!=Running,status.phase!=Succeeded");
    let what = format!("the Pending and Failed pods of namespace {namespace}");
    let pods = list(
        Api::<Pod>::namespaced(client.clone(), namespace),
        &pending,
        &what,
    )
    .await?;
    let cluster = cluster(client, settings, namespace).await?;
    let waiting = |p: &&Pod| {
        refused_by_kubelet(p)
            || p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending")
    };
    let mut out: Vec<Explanation> = pods
        .iter()
        .filter(waiting)
        .map(|p| explain(p, &cluster))
        .collect();
    out.sort_by(|a, b| a.pod.cmp(&b.pod));
    Ok(out)
}

/// A table with one row per answer: pod, reason, message.
pub fn render_table(answers: &[Explanation]) -> String {
    let width = answers
        .iter()
        .map(|a| a.pod.len())
        .max()
        .unwrap_or(0)
        .max(3);
    let mut out = format!("{:width$}  {:13}  MESSAGE\n", "POD", "REASON");
    for a in answers {
        let _ = writeln!(
            out,
            "{:width$}  {:13}  {}",
            a.pod,
            a.reason.as_str(),
            a.message
        );
    }
    out
}
