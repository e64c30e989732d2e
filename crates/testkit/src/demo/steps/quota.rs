//! Step 5: a Reject-mode GpuQuota through the real webhook over HTTPS: the pod that fits is
//! allowed and reserved, the next one denied with the reason. Also the AdmissionReview round
//! trip the Queue-mode step uses.

use super::{list, Context};
use crate::demo::summary::Outcome;
use crate::demo::{Narrator, QUOTA_NAME, REJECT_GPUS, REJECT_NAMESPACE};
use crate::doubles::admission::{claim_create_review, pod_create_review};
use gpuplane_model::quota::catalog::GPU_RESOURCE;
use gpuplane_model::quota::{GpuQuota, ReservationState};
use kube::api::Api;
use serde_json::{json, Value};

pub(super) async fn run(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let ns = REJECT_NAMESPACE;
    say.say(format!(
        "GpuQuota {ns}/{QUOTA_NAME}: hard gpus {REJECT_GPUS}, mode Reject; AdmissionReviews over HTTPS to {}",
        cx.webhook
    ));
    let a = gpu_pod(ns, "pod-a", REJECT_GPUS as u32);
    let b = gpu_pod(ns, "pod-b", 1);
    let (a_ok, _) = match validate(cx, &a, &format!("{REJECT_GPUS} x"), say).await {
        Ok(v) => v,
        Err(e) => return Outcome::Failed(e),
    };
    let (b_ok, b_msg) = match validate(cx, &b, "1 x", say).await {
        Ok(v) => v,
        Err(e) => return Outcome::Failed(e),
    };
    let reserved = match reserved(cx, ns, say).await {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(e),
    };
    match (a_ok, b_ok) {
        (true, false) if !b_msg.is_empty() && reserved == ["pod-a"] => {
            Outcome::Held(format!("pod-a allowed and reserved; pod-b denied: {b_msg}"))
        }
        (true, false) => Outcome::Failed(format!(
            "pod-b denied ({b_msg:?}) but the quota reserves [{}]",
            list(&reserved)
        )),
        _ => Outcome::Failed(format!(
            "pod-a {}, pod-b {} (expected allowed, denied)",
            if a_ok { "allowed" } else { "denied" },
            if b_ok { "allowed" } else { "denied" }
        )),
    }
}

/// The validating webhook's verdict on `pod`, narrated (`asks` says how many GPUs it asks
/// for): (allowed, message).
async fn validate(
    cx: &Context<'_>,
    pod: &Value,
    asks: &str,
    say: &mut Narrator<'_>,
) -> Result<(bool, String), String> {
    let (ok, msg, _) = review(cx, "/validate", pod).await?;
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    say.say(format!(
        "{name} asks for {asks} {GPU_RESOURCE} -> {}",
        if ok {
            "allowed".to_string()
        } else {
            format!("denied: {msg}")
        }
    ));
    Ok((ok, msg))
}

/// The names the GpuQuota's status reserves, narrated with its reserved total.
async fn reserved(
    cx: &Context<'_>,
    ns: &str,
    say: &mut Narrator<'_>,
) -> Result<Vec<String>, String> {
    let q = Api::<GpuQuota>::namespaced(cx.client.clone(), ns)
        .get(QUOTA_NAME)
        .await
        .map_err(|e| format!("reading GpuQuota {ns}/{QUOTA_NAME}: {e}"))?;
    let status = q.status.unwrap_or_default();
    let reserved: Vec<String> = status
        .reservations
        .iter()
        .filter(|r| r.state == ReservationState::Reserved)
        .map(|r| r.name.clone())
        .collect();
    say.say(format!(
        "GpuQuota status: reserved gpus {}, reservations [{}]",
        status.reserved.gpus,
        list(&reserved)
    ));
    Ok(reserved)
}

/// A pod of one container asking for `gpus` whole GPUs through the device plugin resource.
pub(super) fn gpu_pod(namespace: &str, name: &str, gpus: u32) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{namespace}-{name}")},
        "spec": {"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {GPU_RESOURCE: gpus.to_string()}}}]}
    })
}

/// The webhook's verdict on creating `pod` (or a ResourceClaim): (allowed, message, base64
/// patch).
pub(super) async fn review(
    cx: &Context<'_>,
    path: &str,
    pod: &Value,
) -> Result<(bool, String, Option<String>), String> {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let (status, answer) = cx
        .pki
        .post_json(
            cx.webhook,
            path,
            &match pod["kind"].as_str() {
                Some("ResourceClaim") => claim_create_review(&format!("review-{name}"), pod),
                _ => pod_create_review(&format!("review-{name}"), pod),
            },
        )
        .await
        .map_err(|e| e.to_string())?;
    let r = &answer["response"];
    if status != 200 || r["uid"] != format!("review-{name}") {
        return Err(format!("the webhook answered {status}: {answer}"));
    }
    Ok((
        r["allowed"] == true,
        r["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        r["patch"].as_str().map(str::to_string),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    #[test]
    fn the_pod_reviews_pass_the_webhooks_strict_decoding() {
        let pod = gpu_pod("team-a", "p", 2);
        let body = serde_json::to_vec(&pod_create_review("u-1", &pod)).unwrap_or_default();
        let req =
            gpuplane_cluster::webhook::review::decode(&body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(req.uid, "u-1");
        assert_eq!(req.operation, "CREATE");
        assert_eq!(req.namespace.as_deref(), Some("team-a"));
        let p: Pod = serde_json::from_value(pod).unwrap_or_else(|e| panic!("{e}"));
        assert!(!super::super::pod_group::gated(&p));
    }
}
