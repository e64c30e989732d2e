//! `gpuplane explain` against the API server double, through the binary: a pod carrying the
//! controller's answer (condition `gpuplane.dev/GPUsAvailable`, False) is answered from it with
//! one request, `--live` and a pod without it compute from the cluster's lists, and the
//! namespace view reads the cluster only when some pod carries no answer.

use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Output;

const NS: &str = "team-a";
/// What the controller wrote: deliberately not what computing gives (Capacity), so each
/// answer shows where it came from.
const KEPT: &str = "needs 4 nvidia.com/gpu; 6 free across 3 nodes, at most 2 on one: a 2, b 2, c 2";
const COMPUTED: &str = "needs 4 nvidia.com/gpu; 2 free in the cluster";
const SINCE: &str = "2026-12-03T11:00:00Z";

/// A cluster of one node with 2 GPUs and, in team-a, pod `kept` asking 4 with the
/// controller's Fragmentation answer and pod `bare` asking 4 without one.
async fn cluster() -> ApiServerDouble {
    let server = ApiServerDouble::start().await.unwrap();
    server
        .put_json(
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"},
            "status": {"allocatable": {"nvidia.com/gpu": "2", "cpu": "64"},
                "conditions": [{"type": "Ready", "status": "True"}]}}),
        )
        .unwrap();
    let cond = json!({"type": "gpuplane.dev/GPUsAvailable", "status": "False",
        "reason": "Fragmentation", "message": KEPT, "lastTransitionTime": SINCE});
    for (name, conditions) in [("kept", json!([cond])), ("bare", json!([]))] {
        server
            .put_json(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"namespace": NS, "name": name, "uid": format!("uid-{name}")},
                "spec": {"containers": [{"name": "c", "image": "x",
                    "resources": {"limits": {"nvidia.com/gpu": "4"}}}]},
                "status": {"phase": "Pending", "conditions": conditions}}))
            .unwrap();
    }
    server
}

/// `gpuplane explain ARGS --kubeconfig` pointing at `server`, run off the runtime's thread so
/// the double keeps serving.
async fn gpuplane(server: &ApiServerDouble, dir: &Path, args: &[&str]) -> Output {
    let kubeconfig = dir.join("kubeconfig");
    let config = format!(
        "apiVersion: v1\nkind: Config\nclusters: [{{name: d, cluster: {{server: \"{}\"}}}}]\nusers: [{{name: u, user: {{}}}}]\ncontexts: [{{name: c, context: {{cluster: d, user: u}}}}]\ncurrent-context: c\n",
        server.url()
    );
    std::fs::write(&kubeconfig, config).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gpuplane"));
    cmd.arg("explain")
        .args(args)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("RUST_LOG", "warn");
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

async fn json_of(server: &ApiServerDouble, dir: &Path, args: &[&str]) -> Value {
    let out = gpuplane(server, dir, &[args, &["-o", "json"]].concat()).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gpuplane explain {args:?}: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// How many requests listed what only a computed answer needs.
fn cluster_lists(server: &ApiServerDouble) -> usize {
    [
        "/nodes",
        "/resourceslices",
        "/deviceclasses",
        "/resourceclaims",
    ]
    .iter()
    .map(|p| server.count_requests("GET", p))
    .sum()
}

#[tokio::test]
async fn explain_pod_answers_from_the_controllers_condition_with_one_request() {
    let server = cluster().await;
    let dir = tempfile::tempdir().unwrap();
    let target = format!("{NS}/kept");
    let kept = json_of(&server, dir.path(), &["pod", &target]).await;
    let want = json!({"namespace": NS, "pod": "kept", "reason": "Fragmentation",
        "message": KEPT, "source": "controller", "since": SINCE});
    assert_eq!(kept, want);
    assert_eq!(
        server.requests(),
        [(
            "GET".to_string(),
            format!("/api/v1/namespaces/{NS}/pods/kept")
        )]
    );

    // --live computes from the cluster, condition or not.
    server.clear_requests();
    let live = json_of(&server, dir.path(), &["pod", &target, "--live"]).await;
    assert_eq!(
        (&live["reason"], &live["message"], &live["source"]),
        (&json!("Capacity"), &json!(COMPUTED), &json!("computed")),
        "{live}"
    );
    assert!(live.get("since").is_none(), "{live}");
    assert_eq!(server.count_requests("GET", "/api/v1/nodes"), 1);

    // No condition: computed.
    server.clear_requests();
    let bare = json_of(&server, dir.path(), &["pod", &format!("{NS}/bare")]).await;
    assert_eq!(
        (&bare["reason"], &bare["source"]),
        (&json!("Capacity"), &json!("computed")),
        "{bare}"
    );
    assert_eq!(server.count_requests("GET", "/api/v1/nodes"), 1);

    // A missing pod is named.
    let out = gpuplane(&server, dir.path(), &["pod", &format!("{NS}/nope")]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("pod team-a/nope not found"), "{stderr}");
}

#[tokio::test]
async fn explain_namespace_reads_the_cluster_only_for_pods_without_the_controllers_answer() {
    let server = cluster().await;
    let dir = tempfile::tempdir().unwrap();
    let answers = json_of(&server, dir.path(), &["namespace", NS]).await;
    let got: Vec<(&Value, &Value, &Value)> = answers
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (&a["pod"], &a["reason"], &a["source"]))
        .collect();
    let (bare, kept) = (json!("bare"), json!("kept"));
    let (capacity, fragmentation) = (json!("Capacity"), json!("Fragmentation"));
    let (computed, controller) = (json!("computed"), json!("controller"));
    assert_eq!(
        got,
        [
            (&bare, &capacity, &computed),
            (&kept, &fragmentation, &controller)
        ]
    );
    assert_eq!(cluster_lists(&server), 4);

    // Every pod answered by the controller: the pods' list and Kueue's two (a job Kueue holds
    // has no pod to carry an answer), nothing else.
    server.delete_json("v1", "pods", Some(NS), "bare").unwrap();
    server.clear_requests();
    let out = gpuplane(&server, dir.path(), &["namespace", NS]).await;
    let table = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines,
        [
            "POD   REASON         SOURCE      MESSAGE".to_string(),
            format!("kept  Fragmentation  controller  {KEPT}"),
        ]
    );
    assert_eq!(server.requests().len(), 3, "{:?}", server.requests());
    assert_eq!(cluster_lists(&server), 0);
}

/// The fields docs/troubleshooting.md promises scripts in `explain -o json` are exactly those the
/// product writes, with either source.
#[test]
fn the_documented_json_fields_are_the_ones_written() {
    use gpuplane_cluster::explain_cli::{Explanation, Reason, Source};
    let docs = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/troubleshooting.md"),
    )
    .unwrap();
    let table = docs
        .split("`-o json` prints")
        .nth(1)
        .expect("the JSON fields section")
        .split("\n\n")
        .nth(1)
        .expect("its table");
    let mut documented: Vec<String> = table
        .lines()
        .skip(2)
        .filter_map(|row| row.split('|').nth(1))
        .flat_map(|cell| {
            cell.split(',')
                .map(|f| f.trim().trim_matches('`').to_string())
        })
        .collect();
    documented.sort();
    let mut written: Vec<String> = [
        Source::Computed,
        Source::Controller {
            since: Some("2026-12-06T10:00:00Z".into()),
        },
    ]
    .into_iter()
    .flat_map(|source| {
        let answer = Explanation {
            namespace: "ns".into(),
            pod: "p".into(),
            reason: Reason::Capacity,
            message: "needs 4 nvidia.com/gpu; 2 free in the cluster".into(),
            source,
        };
        let v = serde_json::to_value(answer).unwrap();
        v.as_object().unwrap().keys().cloned().collect::<Vec<_>>()
    })
    .collect();
    written.sort();
    written.dedup();
    assert_eq!(documented, written);
}

/// A Job Kueue keeps suspended has no pod to carry an answer: `explain job` and `explain
/// namespace` read its Workload and LocalQueue and answer `Kueue` with Kueue's own message;
/// a pod at Kueue's gate is answered from its Workload too.
#[tokio::test]
async fn a_job_or_pod_kueue_holds_is_answered_with_kueues_reason_and_message() {
    use gpuplane_testkit::doubles::apiserver::ResourceInfo;
    let server = cluster().await;
    for (group, version, plural, kind) in [
        ("batch", "v1", "jobs", "Job"),
        ("kueue.x-k8s.io", "v1beta2", "workloads", "Workload"),
        ("kueue.x-k8s.io", "v1beta2", "localqueues", "LocalQueue"),
    ] {
        server.register(ResourceInfo::new(group, version, plural, kind, true).with_status());
    }
    let why = "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor default-flavor, 2 more needed";
    let pending = json!([{"type": "QuotaReserved", "status": "False", "reason": "Pending",
        "message": why, "lastTransitionTime": SINCE}]);
    let gpus =
        json!({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]});
    server
        .put_json(json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"namespace": NS, "name": "train", "uid": "job-uid"},
            "spec": {"suspend": true, "template": {"spec": gpus}}}))
        .unwrap();
    // A plain pod at Kueue's gate, and its Workload.
    server
        .put_json(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": NS, "name": "gated", "uid": "uid-gated",
                "labels": {"kueue.x-k8s.io/queue-name": "team"}},
            "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}],
                "containers": gpus["containers"].clone()},
            "status": {"phase": "Pending"}}))
        .unwrap();
    for (name, owner_kind, owner, uid) in [
        ("job-train-1a2b3", "Job", "train", "job-uid"),
        ("pod-gated-4c5d6", "Pod", "gated", "uid-gated"),
    ] {
        server
            .put_json(json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                "metadata": {"namespace": NS, "name": name,
                    "ownerReferences": [{"apiVersion": "v1", "kind": owner_kind, "name": owner, "uid": uid}]},
                "spec": {"queueName": "team", "podSets": [{"name": "main", "count": 1, "template": {"spec": gpus}}]},
                "status": {"conditions": pending}}))
            .unwrap();
    }
    server
        .put_json(
            json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"namespace": NS, "name": "team"}, "spec": {"clusterQueue": "gpus"},
            "status": {"pendingWorkloads": 2}}),
        )
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let held = |w: &str| {
        format!("held by Kueue: Workload {w} in LocalQueue team (ClusterQueue gpus), 2 pending there: {why}")
    };
    let out = gpuplane(
        &server,
        dir.path(),
        &["job", &format!("{NS}/train"), "-o", "json"],
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answers[0]["pod"], "job/train");
    assert_eq!(answers[0]["reason"], "Kueue");
    assert_eq!(
        answers[0]["message"],
        format!("1 GPU pod not created yet; {}", held("job-train-1a2b3"))
    );
    let out = gpuplane(
        &server,
        dir.path(),
        &["pod", &format!("{NS}/gated"), "-o", "json"],
    )
    .await;
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (answer["reason"].as_str(), answer["message"].as_str()),
        (Some("Kueue"), Some(held("pod-gated-4c5d6").as_str()))
    );
    let out = gpuplane(&server, dir.path(), &["namespace", NS, "-o", "json"]).await;
    let all: Value = serde_json::from_slice(&out.stdout).unwrap();
    let reasons: Vec<(&str, &str)> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["pod"].as_str().unwrap(), a["reason"].as_str().unwrap()))
        .collect();
    assert!(
        reasons.contains(&("job/train", "Kueue")) && reasons.contains(&("gated", "Kueue")),
        "{reasons:?}"
    );
    // Unknown job: a message naming it.
    let out = gpuplane(&server, dir.path(), &["job", &format!("{NS}/nope")]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("job team-a/nope not found"));
}
