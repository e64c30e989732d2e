//! The queue loop beside Kueue (`--kueue`): the GPU pods Kueue governs are neither charged
//! nor queued by a GpuQuota of their namespace, and the quota says so in a condition and an
//! Event; without the flag the same pod is charged as any other.

use super::*;

const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";

/// A running 2-GPU pod that Kueue admitted through LocalQueue `team`.
fn kueue_pod(name: &str) -> serde_json::Value {
    let mut p = pod(name, 2, false);
    p["metadata"]["labels"] = json!({QUEUE_LABEL: "team"});
    p
}

/// A running 2-GPU pod of a Job Kueue admitted (Kueue's pod-set label, owned by the Job).
fn kueue_job_pod(name: &str) -> serde_json::Value {
    let mut p = pod(name, 2, false);
    p["metadata"]["labels"] = json!({"kueue.x-k8s.io/podset": "main"});
    p["metadata"]["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job",
        "name": "train", "uid": "job-uid", "controller": true}]);
    p
}

fn is_gated(p: &Pod) -> bool {
    p.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == SCHEDULING_GATE))
}

#[tokio::test]
async fn beside_kueue_its_pods_are_not_charged_and_the_quota_says_whose_they_are() {
    let lab = Lab::start_beside(2, Duration::from_secs(3600), true).await;
    lab.create(kueue_pod("kueue-a")).await;
    lab.create(kueue_job_pod("kueue-b")).await;
    // Kueue's 4 GPUs run; the quota's 2 are still free for a pod of its own.
    lab.create(pod("mine", 2, true)).await;
    eventually_async("our pod to be released", LIMIT, || async {
        !is_gated(&lab.pods.get("mine").await.unwrap())
    })
    .await;
    eventually_async("the Kueue condition", LIMIT, || async {
        let s = lab.quota().await.status.unwrap_or_default();
        s.conditions.iter().any(|c| c.type_ == "KueueShared")
    })
    .await;
    let s = lab.quota().await.status.unwrap();
    let c = s
        .conditions
        .iter()
        .find(|c| c.type_ == "KueueShared")
        .unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "PodsGovernedByKueue")
    );
    assert!(
        c.message.contains("of LocalQueue team") && c.message.contains("of jobs Kueue admitted"),
        "{}",
        c.message
    );
    // Only our pod's reservation or usage: 2 GPUs, never Kueue's 4.
    assert!(s.used.gpus <= Gpus::whole(2), "{:?}", s.used);
    assert!(
        s.reservations.iter().all(|r| r.name == "mine"),
        "{:?}",
        s.reservations
    );
    let events: Api<Event> = Api::namespaced(lab.server.client().unwrap(), QNS);
    let told = events.list(&ListParams::default()).await.unwrap().items;
    assert!(
        told.iter()
            .any(|e| e.reason.as_deref() == Some("KueueShared")
                && e.involved_object.name.as_deref() == Some("default")),
        "{told:?}"
    );
    // Kueue's pods gone: the condition goes with them.
    delete(&lab, "kueue-a").await;
    delete(&lab, "kueue-b").await;
    eventually_async("the Kueue condition to go", LIMIT, || async {
        let s = lab.quota().await.status.unwrap_or_default();
        !s.conditions.iter().any(|c| c.type_ == "KueueShared")
    })
    .await;
    lab.stop().await;
}

#[tokio::test]
async fn without_kueue_the_same_pods_are_charged_and_ours_waits() {
    let lab = Lab::start_beside(2, Duration::from_secs(3600), false).await;
    lab.create(kueue_pod("kueue-a")).await;
    eventually_async("the pod to be charged", LIMIT, || async {
        lab.quota().await.status.unwrap_or_default().used.gpus == Gpus::whole(2)
    })
    .await;
    lab.create(pod("mine", 2, true)).await;
    lab.cycles(3).await;
    assert!(is_gated(&lab.pods.get("mine").await.unwrap()));
    let s = lab.quota().await.status.unwrap();
    assert!(!s.conditions.iter().any(|c| c.type_ == "KueueShared"));
    lab.stop().await;
}
