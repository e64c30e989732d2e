//! Step 10: why a fragmented request is Pending. Node node-a reports what its kubelet (the
//! double) sees: the agent's healthy devices allocatable, and the pods holding some bound to it.
//! Two more GPU nodes join with 2 free GPUs each (their Node objects only: no agent runs for them
//! here). A pod asks for more GPUs than any one node has free, but no more than all of them
//! together: the controller must keep the answer `Fragmentation` on the pod, naming each node's
//! free count, and `gpuplane explain` must read it back (one GET) and compute the same live.

use super::{poll, Context, NODE_NAMESPACE};
use crate::demo::summary::Outcome;
use crate::demo::Narrator;
use crate::doubles::lab::NODE;
use gpuplane_cluster::explain_cli::{Explanation, Reason, Source};
use gpuplane_model::quota::catalog::GPU_RESOURCE;
use gpuplane_model::quota::CatalogSettings;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The other GPU nodes and how many GPUs each has free.
const OTHERS: [&str; 2] = ["node-b", "node-c"];
const OTHERS_FREE: u64 = 2;
/// The waiting pod.
const POD: &str = "big-train";

pub(super) async fn run(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let Some(view) = cx.lab.kubelet.plugin(GPU_RESOURCE) else {
        return Outcome::Skipped(format!(
            "{} offers no {GPU_RESOURCE} through the device plugin",
            cx.profile
        ));
    };
    let free_a = match report_node_a(cx, say).await {
        Ok(held) => (view.healthy() as u64).saturating_sub(held),
        Err(e) => return Outcome::Failed(e),
    };
    if let Err(e) = other_nodes(cx, say) {
        return Outcome::Failed(e);
    }
    // More than any one node has free, no more than all of them together.
    let ask = free_a.max(OTHERS_FREE) + 1;
    let pods: Api<Pod> = Api::namespaced(cx.client.clone(), NODE_NAMESPACE);
    let pod: Pod = match serde_json::from_value(gpu_pod(POD, ask, None)) {
        Ok(p) => p,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    if let Err(e) = pods.create(&PostParams::default(), &pod).await {
        return Outcome::Failed(format!("creating pod {POD}: {e}"));
    }
    say.say(format!(
        "pod {NODE_NAMESPACE}/{POD} asks for {ask} x {GPU_RESOURCE}: {} free in all, at most {} on one node",
        free_a + OTHERS_FREE * OTHERS.len() as u64,
        free_a.max(OTHERS_FREE)
    ));
    let (kept, live) = match answers(cx, say).await {
        Ok(a) => a,
        Err(e) => return Outcome::Failed(e),
    };
    let mut want = vec![format!("needs {ask} {GPU_RESOURCE}")];
    if free_a > 0 {
        want.push(format!("{NODE} {free_a}"));
    }
    want.extend(OTHERS.iter().map(|n| format!("{n} {OTHERS_FREE}")));
    if let Some(missing) = want.iter().find(|w| !kept.message.contains(w.as_str())) {
        return Outcome::Failed(format!(
            "the answer does not say {missing:?}: {}",
            kept.message
        ));
    }
    if (live.reason, &live.message) != (kept.reason, &kept.message) {
        return Outcome::Failed(format!(
            "the controller says {:?} {:?}, computed live: {:?} {:?}",
            kept.reason, kept.message, live.reason, live.message
        ));
    }
    Outcome::Held(format!("Fragmentation: {}", kept.message))
}

/// A pod of [`NODE_NAMESPACE`] asking for `gpus` whole GPUs, bound to `node` if given.
fn gpu_pod(name: &str, gpus: u64, node: Option<&str>) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NODE_NAMESPACE},
        "spec": {"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {GPU_RESOURCE: gpus.to_string()}}}]}
    });
    if let Some(node) = node {
        pod["spec"]["nodeName"] = json!(node);
        pod["status"] = json!({"phase": "Running"});
    }
    pod
}

/// Node node-a's status as its kubelet reports it (each resource's devices in ListAndWatch as
/// capacity, the healthy ones allocatable) and the pods holding its GPUs bound to it, as the
/// scheduler left them; how many [`GPU_RESOURCE`] those pods hold.
async fn report_node_a(cx: &Context<'_>, say: &mut Narrator<'_>) -> Result<u64, String> {
    let (mut capacity, mut allocatable) = (BTreeMap::new(), BTreeMap::new());
    for (resource, view) in cx.lab.kubelet.plugins() {
        capacity.insert(resource.clone(), view.devices.len().to_string());
        allocatable.insert(resource, view.healthy().to_string());
    }
    let status = json!({"status": {"capacity": capacity, "allocatable": allocatable,
        "conditions": [{"type": "Ready", "status": "True"}]}});
    Api::<Node>::all(cx.client.clone())
        .patch_status(NODE, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(|e| format!("reporting node {NODE}'s status: {e}"))?;
    let mut held = 0;
    let mut running = Vec::new();
    for ((ns, pod, _), by_resource) in cx.lab.kubelet.assignments() {
        let n = by_resource
            .get(GPU_RESOURCE)
            .map_or(0, |ids| ids.len() as u64);
        if ns != NODE_NAMESPACE || n == 0 {
            continue;
        }
        let object = gpu_pod(&pod, n, Some(NODE));
        cx.lab.api.put_json(object).map_err(|e| e.to_string())?;
        held += n;
        running.push(format!("{ns}/{pod} {n}"));
    }
    say.say(format!(
        "node {NODE} (its kubelet's report): {} {GPU_RESOURCE} allocatable; running pods hold {held} ({})",
        allocatable.get(GPU_RESOURCE).map_or("0", String::as_str),
        running.join(", ")
    ));
    Ok(held)
}

/// The other GPU nodes, Ready with [`OTHERS_FREE`] GPUs each and no pods.
fn other_nodes(cx: &Context<'_>, say: &mut Narrator<'_>) -> Result<(), String> {
    for name in OTHERS {
        let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "status": {"capacity": {GPU_RESOURCE: OTHERS_FREE.to_string()},
                "allocatable": {GPU_RESOURCE: OTHERS_FREE.to_string()},
                "conditions": [{"type": "Ready", "status": "True"}]}});
        cx.lab.api.put_json(node).map_err(|e| e.to_string())?;
    }
    say.say(format!(
        "nodes {} join with {OTHERS_FREE} free {GPU_RESOURCE} each (their kubelets' reports; no agent runs for them here)",
        OTHERS.join(", ")
    ));
    Ok(())
}

/// `gpuplane explain pod` once the controller keeps its answer on the pod, and computed live.
async fn answers(
    cx: &Context<'_>,
    say: &mut Narrator<'_>,
) -> Result<(Explanation, Explanation), String> {
    let explain = |live| {
        gpuplane_cluster::explain_cli::pod(
            &cx.client,
            CatalogSettings::default(),
            NODE_NAMESPACE,
            POD,
            live,
        )
    };
    let kept = poll(|| async {
        let e = explain(false).await.map_err(|e| e.to_string())?;
        match (&e.source, e.reason) {
            // Once the controller has seen every node: a node whose objects it has not read
            // yet is simply missing from an early answer.
            (Source::Controller { .. }, Reason::Fragmentation)
                if OTHERS.iter().all(|n| e.message.contains(&format!("{n} "))) =>
            {
                Ok(e)
            }
            (source, reason) => Err(format!("{source:?}: {reason:?}: {}", e.message)),
        }
    })
    .await
    .map_err(|e| format!("the controller's answer on {POD}: {e}"))?;
    say.say(format!(
        "gpuplane explain pod {NODE_NAMESPACE}/{POD} (the controller's condition): {}: {}",
        kept.reason.as_str(),
        kept.message
    ));
    let live = explain(true).await.map_err(|e| e.to_string())?;
    say.say(format!(
        "gpuplane explain pod {NODE_NAMESPACE}/{POD} --live: {}",
        live.reason.as_str()
    ));
    Ok((kept, live))
}
