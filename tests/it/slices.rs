//! The ResourceSlice publisher against the API server double: writes only what differs,
//! survives restarts without writing, repairs deletions by others, retries conflicts,
//! server errors and timeouts, and leaves no orphans behind.

use crate::support::eventually;
use gpuplane_model::health::HealthBook;
use gpuplane_model::inventory::{DeviceUuid, Inventory};
use gpuplane_model::source::DeviceEvent;
use gpuplane_node::slices::{
    keep_published, render, LoopOptions, RetryPolicy, SlicePublisher, UNHEALTHY_TAINT_KEY,
};
use gpuplane_testkit::doubles::apiserver::{ApiServerDouble, Fault};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long the publisher gets to show a change.
const WAIT: Duration = Duration::from_secs(15);

const DRIVER: &str = "gpu.gpuplane.dev";
const NODE: &str = "node-a";
const API: &str = "resource.k8s.io/v1";

/// `copies` renumbered copies of a bundled profile's GPUs (`h100-mig-single` x3 = 168 MIG
/// devices, three slices).
fn inventory(profile: &str, copies: u32) -> Inventory {
    let base = gpuplane_model::sim::load(profile).unwrap();
    let mut inv = base.clone();
    inv.gpus.clear();
    inv.topology.links.clear();
    for c in 0..copies {
        for g in &base.gpus {
            let mut g = g.clone();
            g.index += c * base.gpus.len() as u32;
            g.minor = g.index;
            g.uuid = DeviceUuid::parse(format!("GPU-{:08x}-0000-0000-0000-000000000000", g.index))
                .unwrap();
            g.pci_bus_id = format!("00000000:{:02X}:00.0", g.index + 1);
            for (k, m) in g.mig_devices.iter_mut().enumerate() {
                m.uuid = DeviceUuid::parse(format!(
                    "MIG-{:08x}-{k:04x}-0000-0000-000000000000",
                    g.index
                ))
                .unwrap();
                m.parent_uuid = g.uuid.clone();
            }
            inv.gpus.push(g);
        }
    }
    inv
}

fn healthy(inv: &Inventory) -> HealthBook {
    let mut b = HealthBook::default();
    b.set_inventory(inv);
    b
}

fn fast() -> RetryPolicy {
    RetryPolicy {
        attempts: 6,
        initial: Duration::from_millis(20),
        max: Duration::from_millis(200),
    }
}

async fn setup() -> (ApiServerDouble, SlicePublisher) {
    let server = ApiServerDouble::start().await.unwrap();
    let publisher = SlicePublisher::new(server.client().unwrap(), DRIVER, NODE).with_retry(fast());
    (server, publisher)
}

fn stored(server: &ApiServerDouble) -> Vec<Value> {
    server.list_json(API, "resourceslices", None)
}

fn names(server: &ApiServerDouble) -> Vec<String> {
    stored(server)
        .iter()
        .filter_map(|s| s["metadata"]["name"].as_str().map(String::from))
        .collect()
}

fn generations(server: &ApiServerDouble) -> Vec<i64> {
    stored(server)
        .iter()
        .map(|s| s["spec"]["pool"]["generation"].as_i64().unwrap_or(-1))
        .collect()
}

#[tokio::test]
async fn start_up_creates_and_an_unchanged_pool_is_never_written_again() {
    let (server, mut publisher) = setup().await;
    let inv = inventory("h100-mig-single", 3);
    let desired = render(&inv, &healthy(&inv), DRIVER, NODE);
    assert_eq!(desired.len(), 3);

    let stats = publisher.sync(desired.clone()).await.unwrap();
    assert_eq!((stats.created, stats.updated, stats.deleted), (3, 0, 0));
    assert_eq!(server.count_writes(), 3, "{:?}", server.requests());
    assert_eq!(
        names(&server),
        [
            "node-a-gpu-gpuplane-dev-0",
            "node-a-gpu-gpuplane-dev-1",
            "node-a-gpu-gpuplane-dev-2"
        ]
    );
    assert_eq!(generations(&server), [1, 1, 1]);
    for s in stored(&server) {
        assert_eq!(s["spec"]["pool"]["resourceSliceCount"], 3);
        assert_eq!(s["spec"]["nodeName"], NODE);
        assert_eq!(s["spec"]["driver"], DRIVER);
    }

    // Same input again: one LIST, no writes.
    server.clear_requests();
    let stats = publisher.sync(desired.clone()).await.unwrap();
    assert_eq!(stats.writes(), 0);
    assert_eq!(server.count_writes(), 0);
    assert_eq!(server.requests().len(), 1, "{:?}", server.requests());
    assert!(
        server.requests()[0].1.contains("fieldSelector="),
        "{:?}",
        server.requests()
    );

    // Agent restart: a new publisher with no memory, same inventory: still no writes.
    let mut restarted =
        SlicePublisher::new(server.client().unwrap(), DRIVER, NODE).with_retry(fast());
    let stats = restarted
        .sync(render(&inv, &healthy(&inv), DRIVER, NODE))
        .await
        .unwrap();
    assert_eq!(stats.writes(), 0);
    assert_eq!(stats.generation, 1);
    assert_eq!(server.count_writes(), 0);
}

#[tokio::test]
async fn a_health_change_updates_exactly_the_changed_slice() {
    let (server, mut publisher) = setup().await;
    let inv = inventory("h100-mig-single", 3);
    let mut health = healthy(&inv);
    publisher
        .sync(render(&inv, &health, DRIVER, NODE))
        .await
        .unwrap();
    let before: Vec<Value> = stored(&server);

    let policy = gpuplane_model::config::AgentConfig::default().xid_policy;
    let t0 = Instant::now();
    health.on_event(
        &DeviceEvent::Xid {
            gpu_uuid: inv.gpus[10].uuid.clone(),
            mig_uuid: None,
            xid: 48,
        },
        t0,
        &policy,
    );
    server.clear_requests();
    let stats = publisher
        .sync(render(&inv, &health, DRIVER, NODE))
        .await
        .unwrap();
    assert_eq!((stats.created, stats.updated, stats.deleted), (0, 1, 0));
    assert_eq!(server.count_writes(), 1);
    assert_eq!(
        server.count_requests("PUT", "/resourceslices/node-a-gpu-gpuplane-dev-1"),
        1,
        "{:?}",
        server.requests()
    );
    assert_eq!(
        generations(&server),
        [1, 1, 1],
        "one update keeps the pool generation"
    );
    let after = stored(&server);
    assert_eq!(after[0], before[0]);
    assert_eq!(after[2], before[2]);
    let tainted: Vec<&Value> = after[1]["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d.get("taints").is_some())
        .collect();
    assert_eq!(tainted.len(), 7, "the GPU's seven MIG devices");
    assert_eq!(
        tainted[0]["taints"][0],
        json!({"key": UNHEALTHY_TAINT_KEY, "value": "xid-48", "effect": "NoSchedule"})
    );

    // Recovery: the same slice again, and only it.
    health.tick(
        t0 + Duration::from_secs(3600),
        Duration::from_secs(1),
        |_| true,
    );
    server.clear_requests();
    let stats = publisher
        .sync(render(&inv, &health, DRIVER, NODE))
        .await
        .unwrap();
    assert_eq!(stats.updated, 1);
    assert_eq!(server.count_writes(), 1);
    assert_eq!(
        server.count_requests("PUT", "/resourceslices/node-a-gpu-gpuplane-dev-1"),
        1
    );
    assert!(stored(&server)[1]["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .all(|d| d.get("taints").is_none()));
}

#[tokio::test]
async fn slices_deleted_behind_our_back_are_created_again() {
    let (server, mut publisher) = setup().await;
    let inv = inventory("h100-mig-single", 3);
    let desired = render(&inv, &healthy(&inv), DRIVER, NODE);
    publisher.sync(desired.clone()).await.unwrap();

    // One slice gone: it comes back, and the pool moves to a new generation together.
    server
        .delete_json(API, "resourceslices", None, "node-a-gpu-gpuplane-dev-1")
        .unwrap();
    let stats = publisher.sync(desired.clone()).await.unwrap();
    assert_eq!((stats.created, stats.updated, stats.deleted), (1, 2, 0));
    assert_eq!(generations(&server), [2, 2, 2]);

    // The kubelet's start-up: all of this node's slices gone.
    for n in names(&server) {
        server.delete_json(API, "resourceslices", None, &n).unwrap();
    }
    let stats = publisher.sync(desired.clone()).await.unwrap();
    assert_eq!(stats.created, 3);
    assert_eq!(names(&server).len(), 3);
    assert_eq!(publisher.sync(desired).await.unwrap().writes(), 0);
}

#[tokio::test]
async fn conflicts_server_errors_and_timeouts_are_retried() {
    let (server, mut publisher) = setup().await;
    let inv = inventory("h100-mig-single", 3);
    let mut health = healthy(&inv);

    // Two 500s on create: retried, everything lands once.
    server.inject(Fault::status("POST", "/resourceslices", 500).times(2));
    let stats = publisher
        .sync(render(&inv, &health, DRIVER, NODE))
        .await
        .unwrap();
    assert_eq!(stats.created, 3);
    assert!(stats.retries >= 2, "{stats:?}");
    assert_eq!(names(&server).len(), 3);

    // A 409 on the update: re-list, retry.
    let policy = gpuplane_model::config::AgentConfig::default().xid_policy;
    health.on_event(
        &DeviceEvent::Xid {
            gpu_uuid: inv.gpus[0].uuid.clone(),
            mig_uuid: None,
            xid: 79,
        },
        Instant::now(),
        &policy,
    );
    server.inject(Fault::conflict("PUT", "/resourceslices").times(1));
    let stats = publisher
        .sync(render(&inv, &health, DRIVER, NODE))
        .await
        .unwrap();
    assert_eq!((stats.updated, stats.retries), (1, 1));
    assert_eq!(
        stored(&server)[0]["spec"]["devices"][0]["taints"][0]["value"],
        "lost"
    );

    // Someone else edits our slice (a label): the next update keeps their label.
    let mut other = server
        .get_json(API, "resourceslices", None, "node-a-gpu-gpuplane-dev-2")
        .unwrap();
    other["metadata"]["labels"] = json!({"touched": "yes"});
    server.put_json(other).unwrap();
    health.on_lost(&inv.gpus[20].uuid, Instant::now());
    let stats = publisher
        .sync(render(&inv, &health, DRIVER, NODE))
        .await
        .unwrap();
    assert_eq!(stats.updated, 1);
    let slice2 = server
        .get_json(API, "resourceslices", None, "node-a-gpu-gpuplane-dev-2")
        .unwrap();
    assert_eq!(
        slice2["metadata"]["labels"]["touched"], "yes",
        "others' labels are kept"
    );

    // A slow server: two slices change, so the pool moves to a new generation and all three
    // are rewritten. The first PUT times out but lands; the retry re-lists, finds that slice
    // done and completes the new generation without bumping again: three PUTs in all.
    health.tick(
        Instant::now() + Duration::from_secs(3600),
        Duration::ZERO,
        |_| true,
    );
    let generation = generations(&server)[0];
    let mut slow = SlicePublisher::new(server.client().unwrap(), DRIVER, NODE)
        .with_retry(fast())
        .with_call_timeout(Duration::from_secs(1));
    server.inject(Fault::delay("PUT", "/resourceslices", Duration::from_secs(3)).times(1));
    server.clear_requests();
    let stats = slow
        .sync(render(&inv, &health, DRIVER, NODE))
        .await
        .unwrap();
    assert!(stats.retries >= 1, "{stats:?}");
    assert_eq!(server.count_writes(), 3, "{:?}", server.requests());
    assert_eq!(generations(&server), [generation + 1; 3]);
    assert!(stored(&server).iter().all(|s| s["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .all(|d| d.get("taints").is_none())));

    // A server that keeps failing: bounded attempts, a transient error for the caller.
    server.inject(Fault::status("GET", "/resourceslices", 500));
    let err = publisher
        .sync(render(&inv, &healthy(&inv), DRIVER, NODE))
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert!(
        err.to_string().contains("gave up after 6 attempts"),
        "{err}"
    );
}

#[tokio::test]
async fn shrinking_leaves_no_orphans_or_duplicates() {
    let (server, mut publisher) = setup().await;
    let big = inventory("h100-mig-single", 2); // 112 devices: two slices
    let desired = render(&big, &healthy(&big), DRIVER, NODE);
    assert_eq!(desired.len(), 2);
    publisher.sync(desired).await.unwrap();

    // Leftovers: a slice of ours under an old name, one of our names in another pool, and
    // slices of another node and another driver that are none of our business.
    let mut leftover = server
        .get_json(API, "resourceslices", None, "node-a-gpu-gpuplane-dev-1")
        .unwrap();
    for key in ["uid", "resourceVersion", "creationTimestamp"] {
        leftover["metadata"].as_object_mut().unwrap().remove(key);
    }
    let mut old_name = leftover.clone();
    old_name["metadata"]["name"] = json!("node-a-gpu.gpuplane.dev-x7k2p");
    server.put_json(old_name).unwrap();
    let mut other_node = leftover.clone();
    other_node["metadata"]["name"] = json!("node-b-gpu-gpuplane-dev-0");
    other_node["spec"]["nodeName"] = json!("node-b");
    other_node["spec"]["pool"]["name"] = json!("node-b");
    server.put_json(other_node).unwrap();
    let mut other_driver = leftover.clone();
    other_driver["metadata"]["name"] = json!("node-a-gpu-nvidia-com-0");
    other_driver["spec"]["driver"] = json!("gpu.nvidia.com");
    server.put_json(other_driver).unwrap();

    let small = inventory("h100-mig-single", 1); // 56 devices: one slice
    let stats = publisher
        .sync(render(&small, &healthy(&small), DRIVER, NODE))
        .await
        .unwrap();
    assert_eq!(
        (stats.created, stats.updated, stats.deleted),
        (0, 1, 2),
        "{stats:?}"
    );
    let mut left = names(&server);
    left.sort();
    assert_eq!(
        left,
        [
            "node-a-gpu-gpuplane-dev-0",
            "node-a-gpu-nvidia-com-0",
            "node-b-gpu-gpuplane-dev-0"
        ]
    );
    let ours = server
        .get_json(API, "resourceslices", None, "node-a-gpu-gpuplane-dev-0")
        .unwrap();
    assert_eq!(ours["spec"]["pool"]["resourceSliceCount"], 1);
    assert_eq!(ours["spec"]["pool"]["generation"], 2);
    assert_eq!(ours["spec"]["devices"].as_array().unwrap().len(), 56);

    // No devices at all: nothing of ours is left.
    publisher.sync(Vec::new()).await.unwrap();
    let mut left = names(&server);
    left.sort();
    assert_eq!(
        left,
        ["node-a-gpu-nvidia-com-0", "node-b-gpu-gpuplane-dev-0"]
    );
}

#[tokio::test]
async fn invalid_or_foreign_desired_slices_are_refused_without_writing() {
    let (server, mut publisher) = setup().await;
    let inv = gpuplane_model::sim::load("dgx-h100").unwrap();
    let mut bad = render(&inv, &healthy(&inv), DRIVER, NODE);
    bad[0].spec.devices.as_mut().unwrap()[0].name = "Not A Label".into();
    let err = publisher.sync(bad).await.unwrap_err();
    assert!(err.to_string().contains("spec.devices[0].name"), "{err}");
    assert!(!err.is_transient());
    let foreign: Vec<ResourceSlice> = render(&inv, &healthy(&inv), DRIVER, "node-b");
    assert!(publisher.sync(foreign).await.is_err());
    assert_eq!(server.count_writes(), 0);
}

#[tokio::test]
async fn the_loop_follows_desired_changes_and_repairs_deletions() {
    let (server, publisher) = setup().await;
    let inv = inventory("h100-mig-single", 3);
    let mut health = healthy(&inv);
    let (tx, rx) = tokio::sync::watch::channel(render(&inv, &health, DRIVER, NODE));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let options = LoopOptions {
        resync: Duration::from_secs(3600),
        retry: Duration::from_millis(100),
        watch: true,
    };
    let task = tokio::spawn(keep_published(publisher, rx, options, async move {
        let _ = stop_rx.await;
    }));

    eventually("three slices", WAIT, || names(&server).len() == 3).await;

    // The kubelet restarts and deletes this node's slices: they come back.
    for n in names(&server) {
        server.delete_json(API, "resourceslices", None, &n).unwrap();
    }
    eventually("slices re-created", WAIT, || names(&server).len() == 3).await;
    eventually("generation bumped", WAIT, || {
        generations(&server) == [2, 2, 2]
    })
    .await;

    // A health change flows through the watch channel.
    let policy = gpuplane_model::config::AgentConfig::default().xid_policy;
    health.on_event(
        &DeviceEvent::Xid {
            gpu_uuid: inv.gpus[5].uuid.clone(),
            mig_uuid: None,
            xid: 48,
        },
        Instant::now(),
        &policy,
    );
    tx.send(render(&inv, &health, DRIVER, NODE)).unwrap();
    eventually("taint published", WAIT, || {
        stored(&server)[0]["spec"]["devices"][35]
            .get("taints")
            .is_some()
    })
    .await;

    // Quiet now: our own writes' watch events cause no further writes. The watch delivers
    // events in order, and an edit by someone else that calls for no write (an annotation)
    // comes after ours: once the loop has synced on it (listed this node's slices), it has
    // handled the events of its own writes, and nothing was written since.
    server.clear_requests();
    let mut edited = stored(&server)[0].clone();
    edited["metadata"]["annotations"] = json!({"example.com/note": "by hand"});
    server.put_json(edited).unwrap();
    eventually("the loop's sync after the edit", WAIT, || {
        server.requests().iter().any(|(method, path)| {
            method == "GET" && path.contains("/resourceslices") && !path.contains("watch=")
        })
    })
    .await;
    assert_eq!(server.count_writes(), 0, "{:?}", server.requests());

    stop_tx.send(()).unwrap();
    let publisher = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(publisher.node(), NODE);
}

/// Every attribute and capacity name the docs give is one our slices publish (as a selector
/// must name it: `gpu.gpuplane.dev/<name>` for the driver's own, `resource.kubernetes.io/<name>`
/// for Kubernetes' standard ones): the list opening docs/dra.md, and every
/// `device.attributes['gpu.gpuplane.dev'].x`, `device.capacity['gpu.gpuplane.dev'].x` and
/// `resource.kubernetes.io/x` in docs/ and the README. Rendered for every bundled machine.
#[test]
fn every_attribute_the_docs_name_is_published() {
    let qualify = |k: &str| {
        if k.contains('/') {
            k.to_string()
        } else {
            format!("{DRIVER}/{k}")
        }
    };
    let (mut attributes, mut capacities) = (BTreeSet::new(), BTreeSet::new());
    for machine in gpuplane_model::sim::bundled_names() {
        let inv = gpuplane_model::sim::load(machine).unwrap();
        let mut health = HealthBook::default();
        health.set_inventory(&inv);
        for s in render::render(&inv, &health, DRIVER, NODE) {
            for d in s.spec.devices.iter().flatten() {
                attributes.extend(d.attributes.iter().flatten().map(|(k, _)| qualify(k)));
                capacities.extend(d.capacity.iter().flatten().map(|(k, _)| qualify(k)));
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.push(root.join("README.md"));
    let mut named: Vec<(String, &BTreeSet<String>, String)> = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        let file = doc.file_name().unwrap().to_string_lossy().to_string();
        for (prefix, set) in [
            (format!("device.attributes['{DRIVER}']."), &attributes),
            (format!("device.capacity['{DRIVER}']."), &capacities),
        ] {
            for (at, _) in text.match_indices(&prefix) {
                let name: String = text[at + prefix.len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric())
                    .collect();
                named.push((qualify(&name), set, file.clone()));
            }
        }
        const STANDARD: &str = "resource.kubernetes.io/";
        for (at, _) in text.match_indices(STANDARD) {
            let rest = &text[at + STANDARD.len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            // `resource.kubernetes.io/pod-claim-name` and the like are annotations and
            // labels, not attributes (attribute names have no '-').
            if rest[name.len()..].starts_with('-') {
                continue;
            }
            named.push((format!("{STANDARD}{name}"), &attributes, file.clone()));
        }
    }
    // The attribute list opening docs/dra.md (to its sentence's end): every backticked name.
    let dra = std::fs::read_to_string(root.join("docs/dra.md")).unwrap();
    let list = dra
        .split_once("attribute names (")
        .and_then(|(_, rest)| rest.split_once("`."))
        .map(|(list, _)| format!("{list}`"))
        .expect("docs/dra.md lists the attribute names");
    for (i, token) in list.split('`').enumerate() {
        if i % 2 == 1 && token != "..." {
            named.push((
                qualify(token),
                &attributes,
                "dra.md (attribute list)".into(),
            ));
        }
    }
    assert!(
        named.len() > 10,
        "the docs' attribute names were not found: {named:?}"
    );
    let unknown: Vec<String> = named
        .iter()
        .filter(|(name, set, _)| !set.contains(name))
        .map(|(name, _, file)| format!("{file}: {name}"))
        .collect();
    assert!(
        unknown.is_empty(),
        "named in the docs but never published: {unknown:?} (published attributes: {attributes:?}, capacities: {capacities:?})"
    );
}
