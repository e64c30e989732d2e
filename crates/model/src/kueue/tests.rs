use super::*;
use serde_json::json;

fn pod(v: Value) -> Pod {
    serde_json::from_value(v).unwrap()
}

#[test]
fn a_pod_is_kueues_by_its_queue_label_its_gate_or_as_an_owned_pod_of_an_admitted_job() {
    let named = pod(
        json!({"metadata": {"name": "p", "labels": {QUEUE_LABEL: "train"}},
        "spec": {"containers": [], "schedulingGates": [{"name": ADMISSION_GATE}]}}),
    );
    let m = managed(&named).unwrap();
    assert_eq!(m.queue.as_deref(), Some("train"));
    assert!(m.held);
    let gated = pod(json!({"metadata": {"name": "p"},
        "spec": {"containers": [], "schedulingGates": [{"name": ADMISSION_GATE}]}}));
    assert!(managed(&gated).unwrap().held);
    let job_pod = pod(
        json!({"metadata": {"name": "p", "labels": {PODSET_LABEL: "main"},
        "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "u", "controller": true}]},
        "spec": {"containers": []}}),
    );
    let m = managed(&job_pod).unwrap();
    assert_eq!((m.queue, m.held), (None, false));
    // The pod-set label alone, on a pod nothing owns, is a user's, not Kueue's.
    let by_hand = pod(
        json!({"metadata": {"name": "p", "labels": {PODSET_LABEL: "main"}},
        "spec": {"containers": []}}),
    );
    assert_eq!(managed(&by_hand), None);
    let empty = pod(
        json!({"metadata": {"name": "p", "labels": {QUEUE_LABEL: ""}},
        "spec": {"containers": []}}),
    );
    assert_eq!(managed(&empty), None);
}

fn workload(conditions: Value, admission: Option<&str>) -> Value {
    let mut status = json!({"conditions": conditions});
    if let Some(cq) = admission {
        status["admission"] = json!({"clusterQueue": cq, "podSetAssignments": []});
    }
    json!({"metadata": {"name": "job-train-3-abcde", "namespace": "ml",
            "ownerReferences": [{"kind": "Job", "name": "train-3", "uid": "job-uid"}]},
        "spec": {"queueName": "team", "podSets": [
            {"name": "main", "count": 2, "template": {"spec": {"containers": [
                {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}},
            {"name": "side", "count": 3, "template": {"spec": {"containers": [{"name": "c"}]}}}]},
        "status": status})
}

#[test]
fn a_pending_workload_is_answered_with_its_queues_and_kueues_message() {
    let msg = "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor default, 2 more needed";
    let w = workload(
        json!([{"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": msg,
            "lastTransitionTime": "2026-12-07T00:00:00Z"}]),
        None,
    );
    let lq = json!({"metadata": {"name": "team", "namespace": "ml"},
        "spec": {"clusterQueue": "gpus"}, "status": {"pendingWorkloads": 1}});
    let view = KueueView::new(&[w], &[lq]);
    let wl = view.owned_by("job-uid").unwrap();
    assert!(wl.held());
    assert_eq!(
        (wl.gpu_pods, wl.owner_ref()),
        (2, "job/train-3".to_string())
    );
    assert_eq!(view.held_without_pods().count(), 1);
    assert_eq!(
        view.held_message(wl),
        format!("held by Kueue: Workload job-train-3-abcde in LocalQueue team (ClusterQueue gpus), 1 pending there: {msg}")
    );
    // A queue that does not exist is named as such.
    let view = KueueView::new(&[workload(json!([]), None)], &[]);
    assert_eq!(
        view.held_message(view.owned_by("job-uid").unwrap()),
        "held by Kueue: Workload job-train-3-abcde in LocalQueue team (no such LocalQueue): Kueue has not reserved quota for it yet"
    );
}

#[test]
fn stages_follow_kueues_conditions() {
    let t = |ty: &str| json!({"type": ty, "status": "True", "message": ty, "lastTransitionTime": "2026-12-07T00:00:01Z"});
    let reserved =
        Workload::from_json(&workload(json!([t("QuotaReserved")]), Some("gpus"))).unwrap();
    assert_eq!(reserved.stage, Stage::QuotaReserved);
    assert_eq!(reserved.cluster_queue.as_deref(), Some("gpus"));
    let admitted = Workload::from_json(&workload(
        json!([t("QuotaReserved"), t("Admitted")]),
        Some("gpus"),
    ))
    .unwrap();
    assert_eq!(admitted.stage, Stage::Admitted);
    assert!(!admitted.held());
    let done = Workload::from_json(&workload(
        json!([t("Admitted"), t("Finished")]),
        Some("gpus"),
    ))
    .unwrap();
    assert_eq!(done.stage, Stage::Finished);
}
