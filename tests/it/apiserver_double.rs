//! The API server double against the real kube client: CRUD, conflicts, the status
//! subresource, watches (and their recovery), faults, time-outs and the request log.

use gpuplane_testkit::doubles::apiserver::{ApiServerDouble, Fault};
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use k8s_openapi::api::resource::v1::{
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimStatus, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::ResourceExt;
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;

const WAIT: Duration = Duration::from_secs(10);

fn slice(name: &str, node: &str) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: "gpu.gpuplane.dev".into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 1,
                resource_slice_count: 1,
            },
            ..ResourceSliceSpec::default()
        },
    }
}

fn pod(name: &str, node: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

fn api_code<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> (u16, String) {
    match r {
        Err(kube::Error::Api(s)) => (s.code, s.reason),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn slices_are_created_read_and_listed_by_node_with_a_field_selector() {
    let server = ApiServerDouble::start().await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client().unwrap());
    let pp = PostParams::default();
    let a = slices
        .create(&pp, &slice("node-a-gpu", "node-a"))
        .await
        .unwrap();
    slices
        .create(&pp, &slice("node-b-gpu", "node-b"))
        .await
        .unwrap();

    assert!(a.metadata.uid.is_some());
    assert!(a.metadata.creation_timestamp.is_some());
    assert_eq!(a.metadata.generation, Some(1));
    let got = slices.get("node-a-gpu").await.unwrap();
    assert_eq!(got.resource_version(), a.resource_version());

    let on_a = slices
        .list(&ListParams::default().fields("spec.nodeName=node-a"))
        .await
        .unwrap();
    assert_eq!(on_a.items.len(), 1);
    assert_eq!(on_a.items[0].name_any(), "node-a-gpu");
    assert!(on_a.metadata.resource_version.is_some());
    let not_a = slices
        .list(&ListParams::default().fields("spec.nodeName!=node-a,spec.driver=gpu.gpuplane.dev"))
        .await
        .unwrap();
    assert_eq!(not_a.items.len(), 1);

    assert_eq!(
        api_code(slices.create(&pp, &slice("node-a-gpu", "node-a")).await),
        (409, "AlreadyExists".into())
    );
    let mut generated = slice("", "node-c");
    generated.metadata.generate_name = Some("node-c-".into());
    let g = slices.create(&pp, &generated).await.unwrap();
    assert!(g.name_any().starts_with("node-c-") && g.name_any().len() == "node-c-".len() + 5);
}

#[tokio::test]
async fn replacing_with_a_stale_resource_version_is_a_409_conflict() {
    let server = ApiServerDouble::start().await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client().unwrap());
    let first = slices
        .create(&PostParams::default(), &slice("s", "node-a"))
        .await
        .unwrap();

    let mut changed = first.clone();
    changed.spec.pool.generation = 2;
    let second = slices
        .replace("s", &PostParams::default(), &changed)
        .await
        .unwrap();
    assert_eq!(second.metadata.generation, Some(2));
    assert_ne!(second.resource_version(), first.resource_version());

    let mut stale = first.clone();
    stale.spec.pool.generation = 3;
    assert_eq!(
        api_code(slices.replace("s", &PostParams::default(), &stale).await),
        (409, "Conflict".into())
    );
    assert_eq!(
        api_code(
            slices
                .replace("t", &PostParams::default(), &slice("t", "x"))
                .await
        )
        .0,
        404
    );

    // A replace that changes nothing writes nothing: same resourceVersion, no event.
    let again = slices
        .replace("s", &PostParams::default(), &second)
        .await
        .unwrap();
    assert_eq!(again.resource_version(), second.resource_version());
}

#[tokio::test]
async fn the_status_subresource_changes_only_status() {
    let server = ApiServerDouble::start().await.unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(server.client().unwrap(), "team-a");
    let mut claim = ResourceClaim {
        metadata: ObjectMeta {
            name: Some("c".into()),
            ..ObjectMeta::default()
        },
        ..ResourceClaim::default()
    };
    let reserved = ResourceClaimStatus {
        reserved_for: Some(vec![ResourceClaimConsumerReference {
            resource: "pods".into(),
            name: "p".into(),
            uid: "u1".into(),
            ..ResourceClaimConsumerReference::default()
        }]),
        ..ResourceClaimStatus::default()
    };
    claim.status = Some(reserved.clone());
    let created = claims.create(&PostParams::default(), &claim).await.unwrap();
    assert_eq!(
        created.status, None,
        "status is the server's to set on create"
    );

    // Through /status: status changes, labels in the same body do not.
    let mut with_status = created.clone();
    with_status.status = Some(reserved.clone());
    with_status.metadata.labels = Some([("x".to_string(), "y".to_string())].into());
    let s = claims
        .replace_status("c", &PostParams::default(), &with_status)
        .await
        .unwrap();
    assert_eq!(s.status, Some(reserved.clone()));
    assert_eq!(s.metadata.labels, None);
    assert_eq!(s.metadata.generation, Some(1));

    // Through the main resource: status is ignored.
    let mut cleared = s.clone();
    cleared.status = None;
    cleared.metadata.labels = Some([("x".to_string(), "y".to_string())].into());
    let m = claims
        .replace("c", &PostParams::default(), &cleared)
        .await
        .unwrap();
    assert_eq!(m.status, Some(reserved));
    assert_eq!(m.labels().get("x").map(String::as_str), Some("y"));

    let p = claims
        .patch_status(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"reservedFor": null}})),
        )
        .await
        .unwrap();
    assert_eq!(p.status.and_then(|s| s.reserved_for), None);
}

/// Follows `pods` with kube's watcher, reporting each event as a line.
async fn spy(pods: Api<Pod>, tx: mpsc::Sender<String>) {
    let stream = watcher(pods, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    while let Some(ev) = stream.next().await {
        let line = match ev {
            Ok(watcher::Event::Apply(p)) => format!(
                "apply {} {}",
                p.name_any(),
                p.labels().get("v").cloned().unwrap_or_default()
            ),
            Ok(watcher::Event::Delete(p)) => format!("delete {}", p.name_any()),
            Ok(watcher::Event::InitApply(p)) => format!("init apply {}", p.name_any()),
            Ok(watcher::Event::InitDone) => "init done".into(),
            Ok(watcher::Event::Init) => continue,
            Err(e) => format!("error {e}"),
        };
        if tx.send(line).await.is_err() {
            return;
        }
    }
}

async fn next_event(rx: &mut mpsc::Receiver<String>) -> String {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| "timed out".into())
}

#[tokio::test]
async fn a_watcher_sees_added_modified_deleted_and_recovers_after_dropped_watches() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(spy(pods.clone(), tx));
    assert_eq!(next_event(&mut rx).await, "init done");

    pods.create(&PostParams::default(), &pod("p1", "node-a"))
        .await
        .unwrap();
    assert_eq!(next_event(&mut rx).await, "apply p1 ");
    pods.patch(
        "p1",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"v": "2"}}})),
    )
    .await
    .unwrap();
    assert_eq!(next_event(&mut rx).await, "apply p1 2");

    let watches_before = server.count_requests("GET", "watch=true");
    server.drop_watches();
    pods.create(&PostParams::default(), &pod("p2", "node-a"))
        .await
        .unwrap();
    assert_eq!(next_event(&mut rx).await, "apply p2 ");
    assert!(server.count_requests("GET", "watch=true") > watches_before);

    pods.delete("p1", &DeleteParams::default()).await.unwrap();
    assert_eq!(next_event(&mut rx).await, "delete p1");

    // Watches failing for a while: the watcher retries and resumes without a relist.
    server.fail_watches(Duration::from_millis(300));
    pods.delete("p2", &DeleteParams::default()).await.unwrap();
    let mut seen = next_event(&mut rx).await;
    while seen.starts_with("error") {
        seen = next_event(&mut rx).await;
    }
    assert_eq!(seen, "delete p2");
    task.abort();
}

#[tokio::test]
async fn a_watcher_that_fell_behind_a_compaction_relists() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(spy(pods.clone(), tx));
    assert_eq!(next_event(&mut rx).await, "init done");

    let outage = server.inject(Fault::status("GET", "watch=", 500));
    server.drop_watches();
    pods.create(&PostParams::default(), &pod("p1", "node-a"))
        .await
        .unwrap();
    server.compact();
    server.clear_fault(outage);

    let mut seen = Vec::new();
    while seen.last().map(String::as_str) != Some("init done") {
        let e = next_event(&mut rx).await;
        assert_ne!(e, "timed out", "{seen:?}");
        if !e.starts_with("error") {
            seen.push(e);
        }
    }
    assert_eq!(seen, ["init apply p1", "init done"]);
}

#[tokio::test]
async fn a_watch_from_a_compacted_resource_version_gets_410_gone() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    let p = pods
        .create(&PostParams::default(), &pod("p", "n"))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &pod("q", "n"))
        .await
        .unwrap();
    server.compact();
    let stream = pods
        .watch(&WatchParams::default(), &p.resource_version().unwrap())
        .await
        .unwrap();
    let mut stream = std::pin::pin!(stream);
    match stream.next().await {
        Some(Ok(WatchEvent::Error(s))) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
        other => panic!("expected 410, got {:?}", other.map(|r| r.map(|_| ()))),
    }
}

#[tokio::test]
async fn a_watch_ends_after_its_timeout_seconds_with_a_bookmark() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    pods.create(&PostParams::default(), &pod("p", "n"))
        .await
        .unwrap();
    let t = Instant::now();
    let stream = pods
        .watch(&WatchParams::default().timeout(1), "0")
        .await
        .unwrap();
    let kinds: Vec<String> = stream
        .map(|e| match e {
            Ok(WatchEvent::Added(p)) => format!("added {}", p.name_any()),
            Ok(WatchEvent::Bookmark(b)) => format!("bookmark {}", b.metadata.resource_version),
            other => format!("{:?}", other.map(|_| ())),
        })
        .collect()
        .await;
    assert!(t.elapsed() < Duration::from_secs(5));
    let rv = server.resource_version();
    assert_eq!(kinds, ["added p".to_string(), format!("bookmark {rv}")]);
}

#[tokio::test]
async fn an_injected_500_reaches_the_client_once() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    pods.create(&PostParams::default(), &pod("p", "n"))
        .await
        .unwrap();
    server.inject(Fault::status("GET", "/pods/p", 500).times(1));
    assert_eq!(api_code(pods.get("p").await), (500, "InternalError".into()));
    assert!(pods.get("p").await.is_ok());
}

#[tokio::test]
async fn a_throttled_request_is_retried_by_the_client_after_retry_after() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    pods.create(&PostParams::default(), &pod("p", "n"))
        .await
        .unwrap();
    server.inject(Fault::throttle("GET", "/pods/p", 1).times(1));
    let t = Instant::now();
    assert!(pods.get("p").await.is_ok());
    assert!(t.elapsed() >= Duration::from_millis(900));
    assert_eq!(server.count_requests("GET", "/pods/p"), 2);
}

#[tokio::test]
async fn a_client_read_timeout_fires_on_an_injected_delay() {
    let server = ApiServerDouble::start().await.unwrap();
    let mut config = server.config().unwrap();
    config.read_timeout = Some(Duration::from_millis(300));
    let pods: Api<Pod> = Api::namespaced(kube::Client::try_from(config).unwrap(), "gpu");
    server.inject(Fault::delay("POST", "/pods", Duration::from_secs(3)).times(1));
    let t = Instant::now();
    assert!(pods
        .create(&PostParams::default(), &pod("p", "n"))
        .await
        .is_err());
    assert!(t.elapsed() < Duration::from_secs(3));
    // The write landed even though the answer never arrived.
    assert!(server.get_json("v1", "pods", Some("gpu"), "p").is_some());
}

#[tokio::test]
async fn deleting_honours_preconditions_and_finalizers() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    let p = pods
        .create(&PostParams::default(), &pod("plain", "n"))
        .await
        .unwrap();
    let stale = DeleteParams::default().preconditions(kube::api::Preconditions {
        resource_version: Some("1".into()),
        uid: None,
    });
    assert_eq!(api_code(pods.delete("plain", &stale).await).0, 409);
    let gone = pods
        .delete("plain", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(gone.left().map(|p| p.metadata.uid), Some(p.metadata.uid));
    assert_eq!(api_code(pods.get("plain").await).0, 404);

    let mut held = pod("held", "n");
    held.metadata.finalizers = Some(vec!["gpuplane.dev/cleanup".into()]);
    pods.create(&PostParams::default(), &held).await.unwrap();
    let marked = pods
        .delete("held", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .unwrap();
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert!(pods.get("held").await.is_ok());
    pods.patch(
        "held",
        &PatchParams::default(),
        &Patch::Json::<()>(
            serde_json::from_value(json!([
                {"op": "remove", "path": "/metadata/finalizers"}
            ]))
            .unwrap(),
        ),
    )
    .await
    .unwrap();
    assert_eq!(api_code(pods.get("held").await).0, 404);
}

#[tokio::test]
async fn server_side_apply_creates_then_merges_and_lists_page() {
    let server = ApiServerDouble::start().await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client().unwrap());
    let pp = PatchParams::apply("gpuplane").force();
    let applied = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "a", "labels": {"node": "a"}},
        "spec": {"driver": "gpu.gpuplane.dev", "nodeName": "a", "pool": {"name": "a", "generation": 1, "resourceSliceCount": 1}},
    });
    let created = slices
        .patch("a", &pp, &Patch::Apply(&applied))
        .await
        .unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    let mut again = applied.clone();
    again["spec"]["pool"]["generation"] = json!(2);
    let updated = slices.patch("a", &pp, &Patch::Apply(&again)).await.unwrap();
    assert_eq!(
        (updated.spec.pool.generation, updated.metadata.generation),
        (2, Some(2))
    );

    for n in ["b", "c"] {
        slices
            .create(&PostParams::default(), &slice(n, n))
            .await
            .unwrap();
    }
    let page = slices.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(page.items.len(), 2);
    let token = page.metadata.continue_.clone().unwrap();
    let rest = slices
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(
        rest.items.iter().map(|s| s.name_any()).collect::<Vec<_>>(),
        ["c"]
    );
    assert_eq!(rest.metadata.continue_, None);
    let labelled = slices
        .list(&ListParams::default().labels("node=a"))
        .await
        .unwrap();
    assert_eq!(labelled.items.len(), 1);
}

#[tokio::test]
async fn count_writes_counts_only_writes() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    pods.create(&PostParams::default(), &pod("p", "n"))
        .await
        .unwrap();
    server.clear_requests();
    pods.get("p").await.unwrap();
    pods.list(&ListParams::default()).await.unwrap();
    assert_eq!(server.count_writes(), 0);
    pods.patch(
        "p",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
    )
    .await
    .unwrap();
    pods.delete("p", &DeleteParams::default()).await.unwrap();
    assert_eq!(server.count_writes(), 2);
    assert_eq!(server.requests().len(), 4);
}

#[tokio::test]
async fn direct_helpers_share_the_store_with_the_client() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), "gpu");
    let stored = server
        .put_json(
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "gpu"},
                          "status": {"phase": "Running"}}),
        )
        .unwrap();
    let got = pods.get("p").await.unwrap();
    assert_eq!(got.status.and_then(|s| s.phase).as_deref(), Some("Running"));
    assert_eq!(
        got.metadata.resource_version,
        stored["metadata"]["resourceVersion"]
            .as_str()
            .map(String::from)
    );
    assert_eq!(server.list_json("v1", "pods", None).len(), 1);
    assert!(server.get_json("v1", "pods", Some("other"), "p").is_none());
}

#[tokio::test]
async fn unknown_resources_are_not_found() {
    let server = ApiServerDouble::start().await.unwrap();
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::all(server.client().unwrap());
    assert_eq!(
        api_code(deployments.list(&ListParams::default()).await),
        (404, "NotFound".into())
    );
}
