//! Kueue's objects as the controller's explainer and `gpuplane explain` read them: Workloads
//! and LocalQueues (`kueue.x-k8s.io/v1beta2`), typed just enough to list and watch; what they
//! mean is the model's (`gpuplane_model::kueue`). Read only: Kueue owns them.

use gpuplane_model::kueue::KueueView;
use kube::api::{Api, ListParams};
use kube::CustomResource;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::borrow::Borrow;

/// A Kueue object's spec or status, as the API server sent it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Fields {
    #[serde(flatten)]
    pub fields: Map<String, Value>,
}

/// Kueue's Workload: one job's (or plain pod's) admission unit.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "kueue.x-k8s.io",
    version = "v1beta2",
    kind = "Workload",
    namespaced,
    schema = "disabled",
    status = "Fields"
)]
pub struct WorkloadSpec {
    #[serde(flatten)]
    pub fields: Map<String, Value>,
}

/// Kueue's LocalQueue: a namespace's door to a ClusterQueue.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "kueue.x-k8s.io",
    version = "v1beta2",
    kind = "LocalQueue",
    namespaced,
    schema = "disabled",
    status = "Fields"
)]
pub struct LocalQueueSpec {
    #[serde(flatten)]
    pub fields: Map<String, Value>,
}

/// The model's view of `workloads` and `queues`.
pub fn view<W: Borrow<Workload>, Q: Borrow<LocalQueue>>(
    workloads: &[W],
    queues: &[Q],
) -> KueueView {
    let json = |v: Result<Value, serde_json::Error>| v.ok();
    let w: Vec<Value> = workloads
        .iter()
        .filter_map(|w| json(serde_json::to_value(w.borrow())))
        .collect();
    let q: Vec<Value> = queues
        .iter()
        .filter_map(|q| json(serde_json::to_value(q.borrow())))
        .collect();
    KueueView::new(&w, &q)
}

/// Every object `api` lists, or none when the cluster does not serve the kind (Kueue is not
/// installed: the API server answers 404).
async fn list_if_served<K>(api: Api<K>) -> Result<Vec<K>, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.list(&ListParams::default()).await {
        Ok(l) => Ok(l.items),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Kueue's Workloads and LocalQueues of `namespace`, listed once (empty where Kueue is not
/// installed).
pub async fn list(client: &kube::Client, namespace: &str) -> Result<KueueView, kube::Error> {
    let (w, q) = tokio::try_join!(
        list_if_served(Api::<Workload>::namespaced(client.clone(), namespace)),
        list_if_served(Api::<LocalQueue>::namespaced(client.clone(), namespace)),
    )?;
    Ok(view(&w, &q))
}
