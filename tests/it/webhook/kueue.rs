//! The webhooks beside Kueue: with `--kueue` the GPU pods Kueue governs pass without our gate,
//! charge or reservation while other GPU pods are still governed; without it such a pod in a
//! namespace with a GpuQuota is refused, naming Kueue, the quota and the flag.

use super::*;

/// A 4-GPU pod sent through LocalQueue `team`, with Kueue's gate as its webhook adds it.
fn kueue_pod(name: &str) -> Value {
    let mut p = gpu_pod(name, "nvidia.com/gpu", 4);
    p["metadata"]["labels"] = json!({"kueue.x-k8s.io/queue-name": "team"});
    p["spec"]["schedulingGates"] = json!([{"name": "kueue.x-k8s.io/admission"}]);
    p
}

/// A 4-GPU pod of a Job Kueue admitted: the pod-set label on its template, owned by the Job.
fn kueue_job_pod(name: &str) -> Value {
    let mut p = gpu_pod(name, "nvidia.com/gpu", 4);
    p["metadata"]["labels"] = json!({"kueue.x-k8s.io/podset": "main"});
    p["metadata"]["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job",
        "name": "train", "uid": "job-uid", "controller": true}]);
    p
}

async fn beside_kueue(api: &ApiServerDouble, pki: &Pki) -> RunningWebhook {
    let mut opts = WebhookOptions::new(pki.cert_path(), pki.key_path(), "gpuplane-system");
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.sync_timeout = Duration::from_secs(10);
    opts.kueue = true;
    webhook::start(api.client().unwrap(), opts).await.unwrap()
}

#[tokio::test]
async fn beside_kueue_its_pods_pass_ungated_and_uncharged_and_ours_are_still_governed() {
    let api = ApiServerDouble::start().await.unwrap();
    let hard = json!({"hard": {"devices": {"nvidia.com/gpu": 1}}, "mode": "Queue"});
    quota(&api, "q", hard).await;
    let pki = Pki::new();
    let wh = beside_kueue(&api, &pki).await;
    let tls = pki.client_config();
    for (i, p) in [kueue_pod("a"), kueue_job_pod("b")].into_iter().enumerate() {
        let uid = format!("k{i}");
        let m = response(&post(&tls, wh.addr(), "/mutate", &pod_review(&uid, p.clone())).await);
        assert_eq!(m["allowed"], true, "{m}");
        assert!(
            m.get("patch").is_none(),
            "no gate of ours on a Kueue pod: {m}"
        );
        let v = response(&post(&tls, wh.addr(), "/validate", &pod_review(&uid, p)).await);
        assert_eq!(v["allowed"], true, "{v}");
    }
    let status = stored_quota(&api, "q").status.unwrap_or_default();
    assert!(status.reservations.is_empty(), "{:?}", status.reservations);
    // A pod of our own is gated and queued as before.
    let mine = gpu_pod("c", "nvidia.com/gpu", 4);
    let m = response(&post(&tls, wh.addr(), "/mutate", &pod_review("c", mine)).await);
    assert_eq!(m["patchType"], "JSONPatch", "{m}");
}

#[tokio::test]
async fn without_kueue_a_kueue_pod_in_a_quota_namespace_is_refused_naming_both_governors() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 8}}}),
    )
    .await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    for (uid, p, mark) in [
        ("k1", kueue_pod("a"), "label kueue.x-k8s.io/queue-name=team"),
        ("k2", kueue_job_pod("b"), "label kueue.x-k8s.io/podset=main"),
    ] {
        let v = response(&post(&tls, wh.addr(), "/validate", &pod_review(uid, p)).await);
        assert_eq!(v["allowed"], false, "{v}");
        let msg = v["status"]["message"].as_str().unwrap();
        for part in [mark, "GpuQuota q", "--kueue", "controller.kueue=true"] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
    }
    assert!(stored_quota(&api, "q")
        .status
        .unwrap_or_default()
        .reservations
        .is_empty());
}
