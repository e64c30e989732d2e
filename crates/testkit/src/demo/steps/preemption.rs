//! Step 11: preemption under a Queue-mode GpuQuota that allows it within the quota
//! (`withinQuota: LowerPriority`). A low-priority pod holds the whole quota; a high-priority
//! pod arrives through the webhooks and is gated. The controller must evict the low-priority
//! pod through the Eviction API (never a plain delete) and say why on it, keep the
//! high-priority pod gated while its victim terminates, and release it once the victim is gone.

use super::pod_group::gated;
use super::quota::{gpu_pod, review};
use super::{facts, poll, Context};
use crate::demo::summary::Outcome;
use crate::demo::{Narrator, PREEMPT_GPUS, PREEMPT_NAMESPACE, QUOTA_NAME};
use crate::doubles::lab::NODE;
use gpuplane_model::quota::GpuQuota;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

/// The running pod and its priority, and the one that preempts it.
const VICTIM: (&str, i32) = ("batch", 10);
const PREEMPTOR: (&str, i32) = ("infer", 1000);
/// Stands for the kubelet still stopping the victim's containers: the evicted pod stays,
/// terminating, until the step removes it.
const KUBELET_FINALIZER: &str = "demo.gpuplane.dev/kubelet-stopping";
/// The condition the controller puts on a pod it preempted.
const PREEMPTED: &str = "gpuplane.dev/Preempted";

pub(super) async fn run(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let ns = PREEMPT_NAMESPACE;
    let pods: Api<Pod> = Api::namespaced(cx.client.clone(), ns);
    say.say(format!(
        "GpuQuota {ns}/{QUOTA_NAME}: hard gpus {PREEMPT_GPUS}, mode Queue, preemption withinQuota LowerPriority"
    ));
    if let Err(e) = start_victim(cx, say).await {
        return Outcome::Failed(e);
    }
    if let Err(e) = arrive(cx, &pods, say).await {
        return Outcome::Failed(e);
    }
    let why = match evicted(cx, &pods, say).await {
        Ok(why) => why,
        Err(e) => return Outcome::Failed(e),
    };
    // The reason the condition gives, without the preemptor it names (said already).
    let why = why.rsplit_once("): ").map_or(why.as_str(), |(_, w)| w);
    match released(&pods, say).await {
        Ok(()) => Outcome::Held(format!(
            "{} (priority {}) evicted through the Eviction API ({PREEMPTED}: {why}); {} (priority {}) gated until it was gone, then released",
            VICTIM.0, VICTIM.1, PREEMPTOR.0, PREEMPTOR.1
        )),
        Err(e) => Outcome::Failed(e),
    }
}

/// A pod of `gpus` GPUs at `priority` in [`PREEMPT_NAMESPACE`].
fn pod(name: &str, priority: i32) -> Value {
    let mut pod = gpu_pod(PREEMPT_NAMESPACE, name, PREEMPT_GPUS as u32);
    pod["spec"]["priority"] = json!(priority);
    pod["spec"]["priorityClassName"] = json!(format!("priority-{priority}"));
    pod
}

/// The low-priority pod, running on the node (as the scheduler and kubelet left it) and
/// counted by the controller against the whole quota.
async fn start_victim(cx: &Context<'_>, say: &mut Narrator<'_>) -> Result<(), String> {
    let (name, priority) = VICTIM;
    let mut victim = pod(name, priority);
    victim["metadata"]["finalizers"] = json!([KUBELET_FINALIZER]);
    victim["spec"]["nodeName"] = json!(NODE);
    victim["status"] = json!({"phase": "Running"});
    cx.lab.api.put_json(victim).map_err(|e| e.to_string())?;
    let quotas: Api<GpuQuota> = Api::namespaced(cx.client.clone(), PREEMPT_NAMESPACE);
    let full = PREEMPT_GPUS.to_string();
    poll(|| async {
        let q = quotas.get(QUOTA_NAME).await.map_err(|e| e.to_string())?;
        let used = q.status.unwrap_or_default().used.gpus.to_string();
        match used == full {
            true => Ok(()),
            false => Err(format!("used gpus {used}")),
        }
    })
    .await
    .map_err(|e| format!("the quota does not count {name}: {e}"))?;
    say.say(format!(
        "pod {name} (priority {priority}, {PREEMPT_GPUS} GPUs) runs on {NODE}: the quota's used gpus is {full} of {PREEMPT_GPUS}"
    ));
    Ok(())
}

/// The high-priority pod through the mutating webhook (which gates it) and the validating one,
/// created with the patch applied, as the API server does.
async fn arrive(cx: &Context<'_>, pods: &Api<Pod>, say: &mut Narrator<'_>) -> Result<(), String> {
    let (name, priority) = PREEMPTOR;
    let mut p = pod(name, priority);
    match review(cx, "/mutate", &p).await? {
        (true, _, Some(patch)) => {
            facts::apply_review_patch(&mut p, &patch).map_err(|e| format!("{name}: {e}"))?
        }
        (true, _, None) => return Err(format!("the mutating webhook did not gate {name}")),
        (false, msg, _) => return Err(format!("{name} denied at mutation: {msg}")),
    }
    if let (false, msg, _) = review(cx, "/validate", &p).await? {
        return Err(format!("{name} denied: {msg}"));
    }
    let p: Pod = serde_json::from_value(p).map_err(|e| e.to_string())?;
    let created = pods
        .create(&PostParams::default(), &p)
        .await
        .map_err(|e| format!("creating {name}: {e}"))?;
    if !gated(&created) {
        return Err(format!("{name} was created without the gate"));
    }
    say.say(format!(
        "pod {name} (priority {priority}, {PREEMPT_GPUS} GPUs) created through the webhooks: gated, the quota is full"
    ));
    Ok(())
}

/// Waits until the victim is evicted (terminating, with the controller's condition) while the
/// preemptor is still gated; then lets the victim's containers stop. The condition's message.
async fn evicted(
    cx: &Context<'_>,
    pods: &Api<Pod>,
    say: &mut Narrator<'_>,
) -> Result<String, String> {
    let (victim, preemptor) = (VICTIM.0, PREEMPTOR.0);
    let why = poll(|| async {
        let v = pods.get(victim).await.map_err(|e| e.to_string())?;
        let terminating = v.metadata.deletion_timestamp.is_some();
        let condition = v
            .status
            .and_then(|s| s.conditions)
            .into_iter()
            .flatten()
            .find(|c| c.type_ == PREEMPTED && c.status == "True");
        match (terminating, condition) {
            (true, Some(c)) => Ok(c.message.unwrap_or_default()),
            (t, c) => Err(format!("{victim}: terminating {t}, condition {c:?}")),
        }
    })
    .await
    .map_err(|e| format!("{victim} was not preempted: {e}"))?;
    let path = format!("/namespaces/{PREEMPT_NAMESPACE}/pods/{victim}/eviction");
    let evictions = cx.lab.api.count_requests("POST", &path);
    let deletes = cx
        .lab
        .api
        .count_requests("DELETE", &format!("/pods/{victim}"));
    say.say(format!(
        "the controller evicted {victim}: {evictions} x POST pods/{victim}/eviction, {deletes} x DELETE; condition {PREEMPTED}: {why}"
    ));
    if evictions == 0 || deletes > 0 {
        return Err(format!(
            "{victim} went by {evictions} eviction(s) and {deletes} delete(s), not the Eviction API alone"
        ));
    }
    let p = pods
        .get(preemptor)
        .await
        .map_err(|e| format!("reading {preemptor}: {e}"))?;
    if !gated(&p) {
        return Err(format!(
            "{preemptor} was released while {victim} still held the quota"
        ));
    }
    let done = json!({"metadata": {"finalizers": null}});
    pods.patch(victim, &PatchParams::default(), &Patch::Merge(&done))
        .await
        .map_err(|e| format!("stopping {victim}: {e}"))?;
    say.say(format!(
        "{preemptor} stays gated while {victim} terminates; {victim}'s containers stop and it is gone"
    ));
    Ok(why)
}

/// Waits until the preemptor is released.
async fn released(pods: &Api<Pod>, say: &mut Narrator<'_>) -> Result<(), String> {
    let name = PREEMPTOR.0;
    poll(|| async {
        let p = pods.get(name).await.map_err(|e| e.to_string())?;
        match gated(&p) {
            false => Ok(()),
            true => Err(format!("{name} is still gated")),
        }
    })
    .await
    .map_err(|e| format!("{name} was not released: {e}"))?;
    say.say(format!(
        "the controller released {name}: the scheduling gate is gone"
    ));
    Ok(())
}
