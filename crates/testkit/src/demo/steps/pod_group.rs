//! Step 6: a pod group under a Queue-mode GpuQuota. Each member goes through the mutating
//! webhook (which gates it) and the validating one; the controller holds them all while the
//! quota is short, then releases the whole group in one cycle once a running pod ends.

use super::quota::{gpu_pod, review};
use super::{facts, list, poll, Context};
use crate::demo::summary::Outcome;
use crate::demo::{Narrator, QUEUE_GPUS, QUEUE_NAMESPACE, QUOTA_NAME};
use crate::doubles::lab::NODE;
use gpuplane_cluster::controller::pods::{GROUP_LABEL, GROUP_SIZE_ANNOTATION};
use gpuplane_model::quota::SCHEDULING_GATE;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{json, Value};

pub(super) async fn run(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let ns = QUEUE_NAMESPACE;
    let pods: Api<Pod> = Api::namespaced(cx.client.clone(), ns);
    let members: Vec<String> = (0..QUEUE_GPUS).map(|i| format!("train-{i}")).collect();
    say.say(format!(
        "GpuQuota {ns}/{QUOTA_NAME}: hard gpus {QUEUE_GPUS}, mode Queue; a 2-GPU pod `warmup` already runs"
    ));
    // Already running (bound to the node): it holds half the quota.
    let mut warmup = gpu_pod(ns, "warmup", 2);
    warmup["spec"]["nodeName"] = json!(NODE);
    if let Err(e) = create(&pods, warmup).await {
        return Outcome::Failed(format!("creating pod warmup: {e}"));
    }
    for name in &members {
        if let Err(e) = create_member(cx, &pods, name, members.len()).await {
            return Outcome::Failed(e);
        }
    }
    say.say(format!(
        "pod group `train` of {} x 1 GPU created through the webhooks: each got the scheduling gate {SCHEDULING_GATE}",
        members.len()
    ));
    let note = match held_together(&pods, &members).await {
        Ok(note) => note,
        Err(e) => return Outcome::Failed(format!("the group did not wait: {e}")),
    };
    say.say(format!(
        "the controller holds all {} gated: {note}",
        members.len()
    ));
    let (gates, cycles_between) = match release(cx, &pods, members.len(), say).await {
        Ok(seen) => seen,
        Err(e) => return Outcome::Failed(e),
    };
    match (gates == members.len(), cycles_between) {
        (true, 0) => Outcome::Held(format!(
            "{} members held together ({}), then released in one controller cycle",
            members.len(),
            note.rsplit(": ").next().unwrap_or_default()
        )),
        _ => Outcome::Failed(format!(
            "{gates} gate removals spread over {} cycles",
            cycles_between + 1
        )),
    }
}

/// Whether `p` still carries the quota's scheduling gate.
pub(super) fn gated(p: &Pod) -> bool {
    p.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == SCHEDULING_GATE))
}

/// The `QuotaAdmitted` condition of a pod: (status, message).
fn admitted_condition(p: &Pod) -> Option<(String, String)> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "QuotaAdmitted")
        .map(|c| (c.status.clone(), c.message.clone().unwrap_or_default()))
}

async fn create(pods: &Api<Pod>, pod: Value) -> Result<Pod, String> {
    let pod: Pod = serde_json::from_value(pod).map_err(|e| e.to_string())?;
    pods.create(&PostParams::default(), &pod)
        .await
        .map_err(|e| e.to_string())
}

/// One member of a group of `size`: through the mutating webhook (which gates it), the
/// validating one, and created with the patch applied, as the API server does.
async fn create_member(
    cx: &Context<'_>,
    pods: &Api<Pod>,
    name: &str,
    size: usize,
) -> Result<(), String> {
    let mut pod = gpu_pod(QUEUE_NAMESPACE, name, 1);
    pod["metadata"]["labels"] = json!({GROUP_LABEL: "train"});
    pod["metadata"]["annotations"] = json!({GROUP_SIZE_ANNOTATION: size.to_string()});
    match review(cx, "/mutate", &pod).await? {
        (true, _, Some(patch)) => {
            facts::apply_review_patch(&mut pod, &patch).map_err(|e| format!("{name}: {e}"))?
        }
        (true, _, None) => return Err(format!("the mutating webhook did not gate {name}")),
        (false, msg, _) => return Err(format!("{name} denied at mutation: {msg}")),
    }
    match review(cx, "/validate", &pod).await? {
        (true, _, _) => {}
        (false, msg, _) => return Err(format!("{name} denied: {msg}")),
    }
    match create(pods, pod).await {
        Ok(p) if gated(&p) => Ok(()),
        Ok(_) => Err(format!("{name} was created without the gate")),
        Err(e) => Err(format!("creating {name}: {e}")),
    }
}

/// Waits until the controller holds every member gated with a `QuotaAdmitted=False`
/// condition; that condition's message.
async fn held_together(pods: &Api<Pod>, members: &[String]) -> Result<String, String> {
    let notes = poll(|| async {
        let mut notes = Vec::new();
        for name in members {
            let p = pods.get(name).await.map_err(|e| e.to_string())?;
            match admitted_condition(&p) {
                Some((s, m)) if s == "False" && gated(&p) => notes.push(m),
                other => return Err(format!("{name}: gated {}, condition {other:?}", gated(&p))),
            }
        }
        Ok(notes)
    })
    .await?;
    Ok(notes.into_iter().next().unwrap_or_default())
}

/// Ends the warm-up pod and waits for the group's release: (gate removals, quota reads
/// between the first and the last of them), from the API server's request log.
async fn release(
    cx: &Context<'_>,
    pods: &Api<Pod>,
    members: usize,
    say: &mut Narrator<'_>,
) -> Result<(usize, usize), String> {
    cx.lab.api.clear_requests();
    let released_before = cx.queue.snapshot().released;
    pods.delete("warmup", &DeleteParams::default())
        .await
        .map_err(|e| format!("deleting warmup: {e}"))?;
    say.say("warmup finishes (deleted): 2 GPUs free up");
    poll(|| async {
        let now = pods
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let still: Vec<String> = now
            .items
            .iter()
            .filter(|p| gated(p))
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        match still.is_empty() {
            true => Ok(()),
            false => Err(format!("still gated: {}", list(&still))),
        }
    })
    .await
    .map_err(|e| format!("the group was not released: {e}"))?;
    let (gates, cycles_between) = gate_removals(cx)?;
    // The loop counts its releases once every gate removal of the cycle has answered, a
    // moment after the last pod shows ungated.
    let want = members as u64;
    let count = poll(|| async {
        let n = cx.queue.snapshot().released.saturating_sub(released_before);
        if n >= want {
            Ok(n)
        } else {
            Err(format!("{n} releases counted"))
        }
    })
    .await
    .map_err(|e| format!("the controller's release counter: {e}"))?;
    say.say(format!(
        "the controller removed {gates} gates (PATCH) with {cycles_between} quota reads between them; it counts {count} releases"
    ));
    Ok((gates, cycles_between))
}

/// The gate removals in the API server's request log, and the quota reads between the first
/// and the last. One controller cycle: the removals follow each other with no fresh read of
/// the quotas (which starts every cycle) between them.
fn gate_removals(cx: &Context<'_>) -> Result<(usize, usize), String> {
    let ns = QUEUE_NAMESPACE;
    let log = cx.lab.api.requests();
    let gates: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, (m, p))| {
            m == "PATCH"
                && p.contains(&format!("/namespaces/{ns}/pods/train-"))
                && !p.contains("/status")
        })
        .map(|(i, _)| i)
        .collect();
    let (Some(first), Some(last)) = (gates.first(), gates.last()) else {
        return Err("no gate removal in the API server's request log".into());
    };
    let cycles_between = log[*first..*last]
        .iter()
        .filter(|(m, p)| m == "GET" && p.contains("/gpuquotas") && !p.contains("watch"))
        .count();
    Ok((gates.len(), cycles_between))
}
