//! The namespace labeller: the queue label follows queue-mode GpuQuotas, comes back after removal
//! by hand, and a failed patch is retried.

use super::*;

const QUEUE_LABEL: &str = gpuplane_cluster::controller::queue_label::QUEUE_LABEL;

/// The namespace labeler running against `server` with fast timings; stopped when the sender
/// is dropped or sent to.
fn start_labeler(
    server: &ApiServerDouble,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    use gpuplane_cluster::controller::labeler::{self, LabelerOptions};
    let opts = LabelerOptions {
        batch: Duration::from_millis(10),
        resync: Duration::from_millis(300),
        retry: Duration::from_millis(20),
        retry_cap: Duration::from_millis(200),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = server.client().unwrap();
    let task = tokio::spawn(async move {
        labeler::run(client, opts, async {
            let _ = stopped.await;
        })
        .await
    });
    (stop, task)
}

fn queue_quota(ns: &str, mode: &str) -> serde_json::Value {
    json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "default", "namespace": ns},
        "spec": {"hard": {"gpus": 1}, "mode": mode}})
}

/// The namespace's labels as stored, or None when it does not exist.
fn ns_labels(server: &ApiServerDouble, name: &str) -> Option<serde_json::Value> {
    server
        .get_json("v1", "namespaces", None, name)
        .map(|n| n["metadata"]["labels"].clone())
}

async fn set_mode(server: &ApiServerDouble, ns: &str, mode: &str) {
    let api: Api<GpuQuota> = Api::namespaced(server.client().unwrap(), ns);
    api.patch(
        "default",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"mode": mode}})),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn the_queue_label_follows_queue_quotas_and_comes_back_after_removal_by_hand() {
    let server = ApiServerDouble::start().await.unwrap();
    namespace(&server, "team-q", json!({"team": "q"}));
    namespace(&server, "team-r", json!({"team": "r"}));
    // Labelled by hand, without a Queue quota: the key is the controller's, it goes.
    namespace(
        &server,
        "by-hand",
        json!({QUEUE_LABEL: "true", "team": "h"}),
    );
    let client = server.client().unwrap();
    let quotas = |ns| Api::<GpuQuota>::namespaced(client.clone(), ns);
    for (ns, mode) in [
        ("team-q", "Queue"),
        ("team-r", "Reject"),
        ("ghost", "Queue"),
    ] {
        let q: GpuQuota = serde_json::from_value(queue_quota(ns, mode)).unwrap();
        quotas(ns).create(&PostParams::default(), &q).await.unwrap();
    }
    let (stop, task) = start_labeler(&server);

    let labelled = |ns: &str| ns_labels(&server, ns).is_some_and(|l| l[QUEUE_LABEL] == "true");
    eventually_async(
        "team-q labelled and the hand-set label gone",
        LIMIT,
        || async {
            labelled("team-q")
                && ns_labels(&server, "by-hand").is_some_and(|l| l[QUEUE_LABEL].is_null())
        },
    )
    .await;
    assert_eq!(
        ns_labels(&server, "team-q").unwrap(),
        json!({"team": "q", QUEUE_LABEL: "true"}),
        "other labels stay"
    );
    assert_eq!(ns_labels(&server, "by-hand").unwrap(), json!({"team": "h"}));
    assert_eq!(ns_labels(&server, "team-r").unwrap(), json!({"team": "r"}));

    // Removed by hand (or by a tool applying an old manifest): it comes back.
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            "team-q",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {QUEUE_LABEL: null}}})),
        )
        .await
        .unwrap();
    assert!(!labelled("team-q"));
    eventually_async("the label back on team-q", LIMIT, || async {
        labelled("team-q")
    })
    .await;

    // Switched to Reject: the label goes; back to Queue: it comes back; deleted: it goes.
    set_mode(&server, "team-q", "Reject").await;
    eventually_async("the label off team-q in Reject mode", LIMIT, || async {
        ns_labels(&server, "team-q") == Some(json!({"team": "q"}))
    })
    .await;
    set_mode(&server, "team-r", "Queue").await;
    eventually_async("team-r labelled in Queue mode", LIMIT, || async {
        labelled("team-r")
    })
    .await;
    quotas("team-r")
        .delete("default", &DeleteParams::default())
        .await
        .unwrap();
    eventually_async(
        "the label off team-r with its quota deleted",
        LIMIT,
        || async { ns_labels(&server, "team-r") == Some(json!({"team": "r"})) },
    )
    .await;

    // Several resyncs later: a namespace is never created, nothing but the one label was
    // written, and only through merge patches of namespaces. Each resync decides ghost (it has
    // a Queue quota) again and tries its patch, which 404s: two more such tries, two resyncs.
    let ghost_tries = || server.count_requests("PATCH", "/namespaces/ghost");
    let tried = ghost_tries();
    eventually_async("two more resyncs", LIMIT, || async {
        ghost_tries() >= tried + 2
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap();
    assert!(server.get_json("v1", "namespaces", None, "ghost").is_none());
    for ns in ["team-q", "team-r", "by-hand"] {
        let n = server.get_json("v1", "namespaces", None, ns).unwrap();
        assert_eq!(n["metadata"]["annotations"], json!({"owner": "team"}));
        assert_eq!(n["spec"], json!({"finalizers": ["kubernetes"]}));
    }
    // Writes of Namespace objects: `/api/v1/namespaces[/<name>]`, nothing below a namespace.
    let writes: Vec<(String, String)> = server
        .requests()
        .into_iter()
        .filter(|(m, p)| {
            let path = p.split('?').next().unwrap_or_default();
            m != "GET" && path.starts_with("/api/v1/namespaces") && path.split('/').count() <= 5
        })
        .collect();
    assert!(
        writes.iter().all(|(m, _)| m == "PATCH"),
        "namespace writes: {writes:?}"
    );
    // team-q: add, re-add; team-r: add, remove; by-hand: remove; ghost: tried (404).
    assert!(writes.len() >= 5, "{writes:?}");
}

#[tokio::test]
async fn a_failed_label_patch_is_retried_with_backoff() {
    use gpuplane_testkit::doubles::apiserver::Fault;
    let server = ApiServerDouble::start().await.unwrap();
    namespace(&server, "team-q", json!({}));
    server.inject(Fault::status("PATCH", "/api/v1/namespaces/team-q", 500).times(3));
    server.put_json(queue_quota("team-q", "Queue")).unwrap();
    let (stop, task) = start_labeler(&server);
    eventually_async(
        "team-q labelled despite three failed patches",
        LIMIT,
        || async { ns_labels(&server, "team-q").is_some_and(|l| l[QUEUE_LABEL] == "true") },
    )
    .await;
    assert_eq!(
        server.count_requests("PATCH", "/api/v1/namespaces/team-q"),
        4
    );
    let _ = stop.send(());
    task.await.unwrap();
}
