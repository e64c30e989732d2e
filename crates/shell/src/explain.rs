//! `gpuplane explain`: reads what the pure explainer needs from the API server (the pod or the
//! namespace's pods, every node, every pod bound to a node) and renders its answers. One read
//! per call, no cache: the CLI asks once and exits.

use gpuplane_model::explain::{explain, node_gpus, Explanation};
use gpuplane_model::quota::{CatalogSettings, DeviceCatalog};
use k8s_openapi::api::core::v1::{Node, Pod};
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

/// The cluster's nodes as the explainer sees them, and the catalog that names GPU resources.
async fn cluster(
    client: &kube::Client,
    settings: CatalogSettings,
) -> Result<(Vec<gpuplane_model::explain::NodeGpus>, DeviceCatalog), ExplainError> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(read("nodes"))?
        .items;
    let bound = ListParams::default().fields("spec.nodeName!=");
    let pods = Api::<Pod>::all(client.clone())
        .list(&bound)
        .await
        .map_err(read("the pods bound to nodes"))?
        .items;
    let catalog = DeviceCatalog::new(&[], &[], settings);
    Ok((node_gpus(&nodes, &pods, &catalog), catalog))
}

/// Why pod `namespace/name` is Pending.
pub async fn pod(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
    name: &str,
) -> Result<Explanation, ExplainError> {
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(read(format!("pod {namespace}/{name}")))?
        .ok_or_else(|| ExplainError::NoPod {
            namespace: namespace.into(),
            name: name.into(),
        })?;
    let (nodes, catalog) = cluster(client, settings).await?;
    Ok(explain(&pod, &nodes, &catalog))
}

/// Why each Pending pod of `namespace` is Pending, by name.
pub async fn namespace(
    client: &kube::Client,
    settings: CatalogSettings,
    namespace: &str,
) -> Result<Vec<Explanation>, ExplainError> {
    let pending = ListParams::default().fields("status.phase=Pending");
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&pending)
        .await
        .map_err(read(format!("the Pending pods of namespace {namespace}")))?
        .items;
    let (nodes, catalog) = cluster(client, settings).await?;
    let mut out: Vec<Explanation> = pods.iter().map(|p| explain(p, &nodes, &catalog)).collect();
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
