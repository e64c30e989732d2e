//! Each component's RBAC grants exactly the API calls its code makes, observed by driving the
//! real node agent and the real controller against the API server double.

use super::*;

/// What `--mps-daemons=pods` calls (crates/node/src/mps/pods.rs): the agent's own pod read, this
/// node's daemon pods listed, one created for a GPU that MPS shares use and deleted after its
/// last share (tests/it/mps_pods.rs runs those pods).
async fn mps_daemon_pod_calls(api: &ApiServerDouble, gpu: gpuplane_model::inventory::DeviceUuid) {
    use gpuplane_node::mps::MpsHost;
    api.put_json(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpuplane-node-x1", "namespace": NS},
        "spec": {"nodeName": NODE, "containers": [{"name": "agent", "image": "gpuplane:test"}]}}))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let paths = gpuplane_node::paths::HostPaths::under(dir.path());
    let own = gpuplane_node::mps::pods::PodSettings {
        namespace: NS.into(),
        name: "gpuplane-node-x1".into(),
        nvml_lib: None,
    };
    let pods =
        gpuplane_node::mps::pods::MpsPods::new(api.client().unwrap(), NODE, &own, &paths, None)
            .await
            .unwrap();
    let daemon_pods = || {
        api.list_json("v1", "pods", Some(NS))
            .iter()
            .filter(|p| p["metadata"]["labels"]["app.kubernetes.io/name"] == "gpuplane-mps")
            .count()
    };
    let (p, g) = (pods.clone(), gpu.clone());
    tokio::task::spawn_blocking(move || p.reconcile(&BTreeMap::from([(g, true)])))
        .await
        .unwrap();
    assert_eq!(daemon_pods(), 1);
    tokio::task::spawn_blocking(move || pods.reconcile(&BTreeMap::new()))
        .await
        .unwrap();
    assert_eq!(daemon_pods(), 0);
}

/// Non-resource URLs every authenticated user may GET (the `system:public-info-viewer` and
/// `system:discovery` ClusterRoles): no grant of ours needed.
const PUBLIC_URLS: &[&str] = &["/version", "/healthz", "/livez", "/readyz", "/api", "/apis"];

/// The calls observed, each checked against `granted`; returns the distinct rules used.
fn check_calls(
    calls: &[ApiCall],
    granted: &BTreeMap<Rule, Option<String>>,
    who: &str,
) -> BTreeSet<Rule> {
    let mut used = BTreeSet::new();
    for c in calls {
        match c {
            ApiCall::NonResource { verb, path } => assert!(
                verb == "get" && PUBLIC_URLS.contains(&path.as_str()),
                "{who} calls non-resource {verb} {path}"
            ),
            ApiCall::Resource(r) => {
                let resource = if r.subresource.is_empty() {
                    r.resource.clone()
                } else {
                    format!("{}/{}", r.resource, r.subresource)
                };
                let rule = (r.verb.clone(), r.group.clone(), resource);
                match granted.get(&rule) {
                    None => panic!("{who}'s RBAC does not grant {rule:?} ({c:?})"),
                    Some(Some(ns)) => assert_eq!(
                        r.namespace.as_deref(),
                        Some(ns.as_str()),
                        "{who}: {rule:?} is granted in {ns} only ({c:?})"
                    ),
                    Some(None) => {}
                }
                used.insert(rule);
            }
        }
    }
    used
}

/// Every grant is used, or listed in `unreached` (calls the code makes that the scenario does
/// not reach).
fn check_grants_used(
    granted: &BTreeMap<Rule, Option<String>>,
    used: &BTreeSet<Rule>,
    unreached: &[Rule],
    who: &str,
) {
    for g in granted.keys() {
        assert!(
            used.contains(g) || unreached.contains(g),
            "{who}'s RBAC grants {g:?}, which no call used; used: {used:#?}"
        );
    }
    for u in unreached {
        assert!(
            granted.contains_key(u),
            "{who}: allowlisted {u:?} is not granted"
        );
        assert!(
            !used.contains(u),
            "{who}: {u:?} is reached now: drop it from the allowlist"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_exactly_what_the_node_agent_calls() {
    let mut lab = Lab::new("pcie-l4x4").await;
    // Telemetry on, as deployed: it follows this node's pods.
    lab.telemetry = Some(gpuplane_node::telemetry::TelemetryOptions {
        interval: std::time::Duration::from_millis(100),
        host_proc: None,
        idle: None,
    });
    // A slice of this node left by an earlier inventory: the publisher deletes it.
    lab.api
        .put_json(
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "node-a-gpu-gpuplane-dev-old"},
            "spec": {"driver": DRIVER, "nodeName": NODE,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, "devices": []}}),
        )
        .unwrap();
    // The node's Node object: the agent labels it (and reads its APIs label).
    lab.api
        .put_json(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
        .unwrap();
    let agent = lab.start("health: {recoveryQuietPeriod: 1h}\n");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.eventually("the node labelled", |l| {
        l.api
            .get_json("v1", "nodes", None, NODE)
            .is_some_and(|n| n["metadata"]["labels"]["nvidia.com/gpu.count"] == "4")
    })
    .await;
    lab.eventually("slices published and the old one gone", |l| {
        let s = l.slices();
        !s.is_empty()
            && s.iter()
                .all(|s| s["metadata"]["name"] != "node-a-gpu-gpuplane-dev-old")
    })
    .await;
    // A good claim (claims get), a device going unhealthy (slice update), and a claim for it
    // (an Event on the claim).
    let good = lab.claim("good", &["gpu-0"]);
    lab.prepare(&good).await.unwrap();
    let uuid = lab.sim.discover().unwrap().inventory.gpus[1].uuid.clone();
    lab.sim.inject_xid(&uuid, None, 48);
    lab.eventually("a taint on gpu-1", |l| !l.taints("gpu-1").is_empty())
        .await;
    let bad = lab.claim("bad", &["gpu-1"]);
    lab.prepare(&bad).await.unwrap_err();
    lab.eventually("the Event on the claim", |l| {
        !l.api
            .list_json("events.k8s.io/v1", "events", Some("team-a"))
            .is_empty()
    })
    .await;
    agent.stop().await;
    mps_daemon_pod_calls(
        &lab.api,
        lab.sim.discover().unwrap().inventory.gpus[2].uuid.clone(),
    )
    .await;

    let docs = docs();
    let granted = grants(&docs, NS, "gpuplane-node");
    let used = check_calls(&lab.api.api_calls(), &granted, "gpuplane node");
    // Granted calls this scenario does not reach: the API server's own check of
    // resourceclaims/driver for status.devices writes (the double does not model it; the
    // real-cluster tier does: tests/lab/real_cluster.rs sees the entries written).
    check_grants_used(
        &granted,
        &used,
        &[rule(
            "associated-node:patch",
            "resource.k8s.io",
            "resourceclaims/driver",
        )],
        "gpuplane node",
    );
    for r in [
        rule("list", "resource.k8s.io", "resourceslices"),
        rule("watch", "resource.k8s.io", "resourceslices"),
        rule("create", "resource.k8s.io", "resourceslices"),
        rule("update", "resource.k8s.io", "resourceslices"),
        rule("delete", "resource.k8s.io", "resourceslices"),
        rule("get", "resource.k8s.io", "resourceclaims"),
        rule("create", "events.k8s.io", "events"),
        rule("get", "", "nodes"),
        rule("list", "", "nodes"),
        rule("watch", "", "nodes"),
        rule("patch", "", "nodes"),
        rule("patch", "resource.k8s.io", "resourceclaims/status"),
        rule("get", "", "pods"),
        rule("list", "", "pods"),
        rule("create", "", "pods"),
        rule("delete", "", "pods"),
    ] {
        assert!(used.contains(&r), "{r:?} not observed: {used:#?}");
    }
}

mod tls {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use std::net::SocketAddr;
    use std::path::PathBuf;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::ServerName;

    /// A test CA and a serving certificate for localhost in a temp dir.
    pub struct Pki {
        ca: CertifiedIssuer<'static, KeyPair>,
        pub dir: tempfile::TempDir,
    }

    impl Pki {
        pub fn new() -> Pki {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
            let pki = Pki {
                ca,
                dir: tempfile::tempdir().unwrap(),
            };
            let key = KeyPair::generate().unwrap();
            let cert = CertificateParams::new(vec!["localhost".to_string()])
                .unwrap()
                .signed_by(&key, &pki.ca)
                .unwrap();
            std::fs::write(pki.cert(), cert.pem()).unwrap();
            std::fs::write(pki.key(), key.serialize_pem()).unwrap();
            pki
        }

        pub fn cert(&self) -> PathBuf {
            self.dir.path().join("tls.crt")
        }

        pub fn key(&self) -> PathBuf {
            self.dir.path().join("tls.key")
        }

        /// POSTs `body` to `path` and returns the response body (HTTP/1.1, one connection).
        pub async fn post(&self, addr: SocketAddr, path: &str, body: &[u8]) -> serde_json::Value {
            let cfg = gpuplane_testkit::demo::tls::client_trusting(self.ca.der().clone()).unwrap();
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut conn = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                .connect(ServerName::try_from("localhost").unwrap(), tcp)
                .await
                .unwrap();
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            conn.write_all(head.as_bytes()).await.unwrap();
            conn.write_all(body).await.unwrap();
            let mut out = Vec::new();
            let _ = conn.read_to_end(&mut out).await;
            let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
            let head = String::from_utf8_lossy(&out[..split]).to_ascii_lowercase();
            assert!(head.starts_with("http/1.1 200"), "{head}");
            assert!(!head.contains("transfer-encoding: chunked"), "{head}");
            serde_json::from_slice(&out[split + 4..]).unwrap()
        }
    }
}

fn pod_review(uid: &str, pod: Value) -> Vec<u8> {
    serde_json::to_vec(&gpuplane_testkit::doubles::admission::pod_create_review(
        uid, &pod,
    ))
    .unwrap()
}

fn gpu_pod(ns: &str, name: &str, gated: bool) -> Value {
    let mut spec = json!({"containers": [{"name": "main", "image": "cuda",
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]});
    if gated {
        spec["schedulingGates"] = json!([{"name": gpuplane_model::quota::SCHEDULING_GATE}]);
    }
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}")}, "spec": spec})
}

fn seed_cluster(api: &ApiServerDouble) {
    for ns in ["team-a", "team-b"] {
        api.put_json(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns},
            "spec": {"finalizers": ["kubernetes"]}}),
        )
        .unwrap();
    }
    for d in docs().iter().filter(|d| d.kind() == "DeviceClass") {
        api.put_json(d.value.clone()).unwrap();
    }
    api.put_json(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "n1-gpu-gpuplane-dev-0"},
        "spec": {"driver": DRIVER, "nodeName": "n1",
            "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}},
                "capacity": {"memory": {"value": "16Gi"}}}]}}),
    )
    .unwrap();
    api.put_json(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": "team-a"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu",
            "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}}}),
    )
    .unwrap();
    for (ns, spec) in [
        (
            "team-a",
            json!({"hard": {"gpuMemory": "20Gi"}, "mode": "Reject"}),
        ),
        ("team-b", json!({"hard": {"gpus": "1"}, "mode": "Queue"})),
    ] {
        api.put_json(
            json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": "default", "namespace": ns}, "spec": spec}),
        )
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_exactly_what_the_controller_calls() {
    use gpuplane_cluster::controller::{self, lease::LeaseTimings, ControllerOptions};
    let api = ApiServerDouble::start().await.unwrap();
    seed_cluster(&api);
    // Kueue's CRDs, as its install makes them.
    for (plural, kind) in [("workloads", "Workload"), ("localqueues", "LocalQueue")] {
        use gpuplane_testkit::doubles::apiserver::ResourceInfo;
        let info = ResourceInfo::new("kueue.x-k8s.io", "v1beta2", plural, kind, true);
        api.register(info.with_status());
    }
    let pki = tls::Pki::new();
    let mut opts = gpuplane_cluster::webhook::WebhookOptions::new(pki.cert(), pki.key(), NS);
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.sync_timeout = Duration::from_secs(10);
    // Beside Kueue: every call the controller can make, Kueue's reads included.
    opts.kueue = true;
    let webhook = gpuplane_cluster::webhook::start(api.client().unwrap(), opts)
        .await
        .unwrap();
    let mut loops = ControllerOptions::new(NS, "replica-1");
    loops.lease = LeaseTimings {
        lease_duration: Duration::from_secs(1),
        renew_deadline: Duration::from_millis(600),
        retry_period: Duration::from_millis(100),
    };
    loops.queue.settings.kueue = true;
    loops.queue.batch = Duration::from_millis(20);
    loops.queue.resync = Duration::from_millis(300);
    if let Some(h) = loops.queue.hours.as_mut() {
        h.interval = Duration::from_millis(100);
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = api.client().unwrap();
    let task = tokio::spawn(async move {
        controller::run(
            client,
            loops,
            std::sync::Arc::new(gpuplane_cluster::controller_metrics::QueueMetrics::default()),
            async {
                let _ = stopped.await;
            },
        )
        .await
    });

    // Reject mode, through the webhook: a pod whose claim comes from a template (template
    // get, quota get, reservation written to status).
    let mut a = gpu_pod("team-a", "a", false);
    a["spec"] = json!({"containers": [{"name": "c", "image": "x"}],
        "resourceClaims": [{"name": "g", "resourceClaimTemplateName": "one-gpu"}]});
    let r = pki
        .post(webhook.addr(), "/validate", &pod_review("u1", a))
        .await;
    assert_eq!(r["response"]["allowed"], true, "{r}");
    // Queue mode, through the loops: two gated one-GPU pods under a one-GPU quota: one is
    // released (gate removed), the other waits with a condition and an Event.
    for name in ["q1", "q2"] {
        api.put_json(gpu_pod("team-b", name, true)).unwrap();
    }
    let gated = |name: &str| {
        api.get_json("v1", "pods", Some("team-b"), name).unwrap()["spec"]["schedulingGates"]
            .as_array()
            .is_some_and(|g| !g.is_empty())
    };
    eventually(
        "one pod released and one waiting with an Event",
        LIMIT,
        || {
            (gated("q1") != gated("q2"))
                && !api.list_json("v1", "events", Some("team-b")).is_empty()
        },
    )
    .await;
    // The namespace labeler: team-b (Queue mode) gets the label the gate webhook selects on.
    eventually("the queue label on team-b", LIMIT, || {
        api.get_json("v1", "namespaces", None, "team-b").unwrap()["metadata"]["labels"]
            ["quota.gpuplane.dev/queue"]
            == "true"
    })
    .await;
    // The explainer reads Kueue's Workloads and LocalQueues (a list, then a watch, each).
    eventually("Kueue's objects listed and watched", LIMIT, || {
        let calls = api.api_calls();
        ["workloads", "localqueues"].iter().all(|r| {
            calls
                .iter()
                .any(|c| matches!(c, ApiCall::Resource(c) if c.verb == "watch" && c.resource == *r))
        })
    })
    .await;
    // The leader renews its Lease.
    eventually("a Lease renewal", LIMIT, || {
        api.count_requests("PUT", "/leases/") > 0
    })
    .await;
    // The GPU-hours book: read, created, then replaced.
    eventually("a GPU-hours book update", LIMIT, || {
        api.count_requests("PUT", "/configmaps/") > 0
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    webhook.stop().await;

    let docs = docs();
    let granted = grants(&docs, NS, "gpuplane-controller");
    let used = check_calls(&api.api_calls(), &granted, "gpuplane controller");
    // Granted calls this scenario does not reach, with the code that makes them: evictions
    // (controller/queue/preempt.rs; the double has no Eviction API, so the real API server
    // checks this grant in tests/lab/real_cluster_preemption.rs, which fails on any refusal).
    let unreached = [rule("create", "", "pods/eviction")];
    check_grants_used(&granted, &used, &unreached, "gpuplane controller");
}
