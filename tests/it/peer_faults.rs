//! Peer faults: the agent keeps serving what it can and converges once its peers recover.
//!
//! - The API server double answers 500, 409 and 429, holds answers past the client's timeout
//!   and drops and refuses watches: throughout, the kubelet is served (ListAndWatch follows
//!   health, Allocate works, a prepared claim is answered from the checkpoint) and a claim the
//!   agent cannot read gets a clear per-claim error; afterwards the slices equal the desired
//!   ones and `gpuplane_slice_syncs_total{outcome="failed"}` counted the failures.
//! - The kubelet doubles restart again and again, the agent's sockets vanish, streams are
//!   opened and dropped, and calls carry garbage IDs: each gets its own error, nothing is
//!   removed that should not be, and the agent answers correctly afterwards.
//! - NVML fails at start-up (the fake's `init-fail`): the agent process stays up, `/healthz`
//!   answers, `/readyz` and `gpuplane_discovery_failures_total` say why, and once NVML answers
//!   it serves the GPUs that answer (one is lost).
//!
//! The outages last seconds, standing in for minutes: the agent's retry loops have no end,
//! and the client's read timeout is set short so a held answer is a timeout here.

use crate::support;

use crate::support::{eventually, put_claim, AgentProcess, DRIVER};
use gpuplane_model::inventory::DeviceUuid;
use gpuplane_model::source::{DeviceSource, SimSource};
use gpuplane_node::dra::service::RawClaim;
use gpuplane_node::dra::ClaimRef;
use gpuplane_node::proto::deviceplugin_v1beta1 as dp;
use gpuplane_node::proto::dra_health_v1alpha1 as health;
use gpuplane_node::proto::dra_v1 as v1;
use gpuplane_testkit::doubles::apiserver::{ApiServerDouble, Fault};
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use gpuplane_testkit::doubles::kubelet_dra::{KubeletDraDouble, KubeletDraOptions};
use gpuplane_testkit::doubles::lab::{NodeLab, RunningAgent};
use std::io::Write;
use std::net::SocketAddr;
use std::ops::{Deref, DerefMut};
use std::time::Duration;

/// A hang guard for waits, never a timing assertion.
const WAIT: Duration = Duration::from_secs(30);
const GPU: &str = "nvidia.com/gpu";

/// The real agent in this process on a simulated DGX H100 (so Xids can be injected), with the
/// doubles (the library's `NodeLab`), `/metrics` on a local port and a kube client whose read
/// timeout is 2 s.
struct Node {
    agent: RunningAgent,
    lab: NodeLab,
    _dir: tempfile::TempDir,
    metrics: SocketAddr,
}

impl Deref for Node {
    type Target = NodeLab;
    fn deref(&self) -> &NodeLab {
        &self.lab
    }
}

impl DerefMut for Node {
    fn deref_mut(&mut self) -> &mut NodeLab {
        &mut self.lab
    }
}

impl Node {
    async fn start(config: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let sim = SimSource::new(gpuplane_model::sim::load("dgx-h100").unwrap());
        let lab = NodeLab::start(dir.path(), sim, KubeletDraOptions::default())
            .await
            .unwrap();
        let mut client_config = lab.api.config().unwrap();
        client_config.read_timeout = Some(Duration::from_secs(2));
        let metrics: SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
        let agent = lab
            .start_agent_with_client(
                config,
                Some(metrics),
                kube::Client::try_from(client_config).unwrap(),
            )
            .unwrap();
        let node = Node {
            agent,
            lab,
            _dir: dir,
            metrics,
        };
        node.dra.wait_registered(DRIVER, WAIT).await.unwrap();
        node.kubelet
            .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 8))
            .await
            .unwrap();
        node
    }

    async fn stop(self) {
        assert!(!self.agent.is_finished(), "the agent kept running");
        self.agent.stop().await.unwrap();
    }

    fn uuid(&self, gpu: usize) -> DeviceUuid {
        self.sim.discover().unwrap().inventory.gpus[gpu]
            .uuid
            .clone()
    }

    fn metric(&self, sample: &str) -> f64 {
        support::http_get(self.metrics, "/metrics")
            .and_then(|(_, body)| support::metric_value(&body, sample))
            .unwrap_or(0.0)
    }

    /// The CDI IDs NodePrepareResources answered for `c`, or the claim's error.
    async fn prepare(&self, c: &ClaimRef) -> Result<Vec<String>, String> {
        self.lab
            .prepare(c)
            .await
            .map(|devs| devs.into_iter().flat_map(|d| d.cdi_ids).collect())
    }

    /// An Xid 48 on `gpu`: ListAndWatch must show it unhealthy (the kubelet is served).
    async fn xid(&self, gpu: usize) {
        let uuid = self.uuid(gpu);
        self.sim.inject_xid(&uuid, None, 48);
        self.kubelet
            .wait_for(WAIT, |p| {
                p[GPU]
                    .devices
                    .iter()
                    .any(|d| d.id == uuid && d.health == "Unhealthy")
            })
            .await
            .unwrap();
    }

    async fn tainted(&self, gpu: usize) {
        let device = format!("gpu-{gpu}");
        eventually(&format!("the Xid taint on {device}"), WAIT, || {
            self.taints(&device) == ["gpu.gpuplane.dev/unhealthy=xid-48"]
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_errors_timeouts_and_lost_watches_leave_the_kubelet_served_and_slices_converge()
{
    let node = Node::start("allocation: {podResourcesGrace: 1s}\n").await;
    eventually("the slices", WAIT, || node.slices().len() == 1).await;
    let kept = put_claim(&node.api, "kept", &["gpu-0"]);
    let kept_ids = node.prepare(&kept).await.unwrap();
    let failed = r#"gpuplane_slice_syncs_total{outcome="failed"}"#;
    let failed_before = node.metric(failed);

    // An outage of the resource API: every call 500, open watches dropped.
    let outage = node
        .api
        .inject(Fault::status("*", "/apis/resource.k8s.io/", 500));
    node.api.drop_watches();
    node.xid(5).await;
    let (pod_ids, _) = node
        .kubelet
        .admit("team-b", "pod-1", "main", GPU, 1)
        .await
        .expect("Allocate works without the API server");
    assert_eq!(
        node.prepare(&kept).await.unwrap(),
        kept_ids,
        "a prepared claim is answered from the checkpoint"
    );
    let free = (1..4).find(|g| node.uuid(*g) != pod_ids[0]).unwrap();
    let late = put_claim(&node.api, "late", &[&format!("gpu-{free}")]);
    let err = node.prepare(&late).await.unwrap_err();
    assert!(
        err.contains("team-a/late"),
        "the error names the claim: {err}"
    );
    eventually("a failed sync counted", WAIT, || {
        node.metric(failed) > failed_before
    })
    .await;
    assert!(node.taints("gpu-5").is_empty(), "nothing was written");
    node.api.clear_fault(outage);
    node.tainted(5).await;
    assert_eq!(node.prepare(&late).await.unwrap().len(), 1);
    node.kubelet.end_pod("team-b", "pod-1");

    // Conflicts, then throttling, on the slice writes.
    node.api
        .inject(Fault::conflict("PUT", "/resourceslices").times(3));
    node.xid(6).await;
    node.tainted(6).await;
    node.api
        .inject(Fault::throttle("PUT", "/resourceslices", 0).times(4));
    node.xid(7).await;
    node.tainted(7).await;

    // A server that holds its answers past the client's timeout, for a while.
    node.api.inject(
        Fault::delay("*", "/resourceslices", Duration::from_secs(4))
            .lasting(Duration::from_secs(6)),
    );
    node.xid(4).await;
    node.tainted(4).await;

    // Watches dropped again and again, then refused for a while: a slice deleted behind the
    // agent's back is noticed and published again.
    for _ in 0..5 {
        node.api.drop_watches();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    node.api.fail_watches(Duration::from_secs(3));
    let name = node.slices()[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    node.api
        .delete_json("resource.k8s.io/v1", "resourceslices", None, &name);
    eventually("the deleted slice back", WAIT, || node.slices().len() == 1).await;

    // Converged: exactly the desired slices, valid, with every health taint and nothing else
    // (the pod ended, so its GPU is not in use any more).
    for gpu in [4, 5, 6, 7] {
        node.tainted(gpu).await;
    }
    eventually("no taints on GPUs 0-3", WAIT, || {
        (0..4).all(|g| node.taints(&format!("gpu-{g}")).is_empty())
    })
    .await;
    for s in node.slices() {
        let slice: k8s_openapi::api::resource::v1::ResourceSlice =
            serde_json::from_value(s).unwrap();
        gpuplane_node::slices::validate::validate(&slice).unwrap();
    }
    assert!(node.metric(failed) > failed_before);
    // ListAndWatch: the Xid GPUs and the two claims' GPUs are out, the rest offered.
    let out: Vec<String> = [0, free, 4, 5, 6, 7]
        .iter()
        .map(|g| node.uuid(*g).to_string())
        .collect();
    node.kubelet
        .wait_for(WAIT, |p| {
            p[GPU]
                .devices
                .iter()
                .all(|d| (d.health == "Unhealthy") == out.contains(&d.id))
        })
        .await
        .unwrap();
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restarts_dropped_streams_and_garbage_ids_get_clear_errors_and_the_agent_serves_on()
{
    let mut node = Node::start("").await;
    let claim = put_claim(&node.api, "steady", &["gpu-0"]);
    let ids = node.prepare(&claim).await.unwrap();

    kubelet_sides_restart_and_sockets_vanish(&mut node, &claim, &ids).await;
    streams_opened_and_dropped_leave_the_agent_serving(&node).await;
    garbage_device_ids_get_clear_errors(&node).await;
    garbage_claims_get_clear_errors_and_undo_nothing(&node).await;

    assert_eq!(node.prepare(&claim).await.unwrap(), ids);
    assert_eq!(
        support::http_get(node.metrics, "/healthz").map(|(c, _)| c),
        Some(200)
    );
    node.stop().await;
}

/// Restarts, repeatedly, of both kubelet sides, and the agent's DRA sockets vanishing: served
/// and registered again, and `claim` prepared again to the same `ids`.
async fn kubelet_sides_restart_and_sockets_vanish(
    node: &mut Node,
    claim: &ClaimRef,
    ids: &[String],
) {
    // Restarts, repeatedly, of both kubelet sides.
    for round in 0..4 {
        let before = node.kubelet.registrations().len();
        node.kubelet.restart().await.unwrap();
        node.kubelet
            .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 7))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(node.kubelet.registrations().len() > before);
        let before = node.dra.registrations().len();
        node.dra.restart().await;
        node.dra
            .wait_until(WAIT, "a new DRA registration", |k| {
                k.registrations().len() > before && k.plugin(DRIVER).is_some()
            })
            .await
            .unwrap();
        assert_eq!(node.prepare(claim).await.unwrap(), ids, "round {round}");
    }

    // The agent's DRA sockets vanish: served and registered again.
    let view = node.dra.plugin(DRIVER).unwrap();
    let before = node.dra.registrations().len();
    std::fs::remove_file(&view.registration_socket).unwrap();
    std::fs::remove_file(&view.endpoint).unwrap();
    node.dra
        .wait_until(WAIT, "registration after the sockets vanished", |k| {
            k.registrations().len() > before && k.plugin(DRIVER).is_some()
        })
        .await
        .unwrap();
    assert_eq!(node.prepare(claim).await.unwrap(), ids);
}

/// Streams opened and dropped by the kubelet side, over and over; the kubelet's own stream
/// still follows.
async fn streams_opened_and_dropped_leave_the_agent_serving(node: &Node) {
    // Streams opened and dropped by the kubelet side, over and over.
    let dp_endpoint = node.kubelet.plugin(GPU).unwrap().endpoint;
    let dra_endpoint = node.dra.plugin(DRIVER).unwrap().endpoint;
    for _ in 0..20 {
        let channel = gpuplane_node::grpc::connect(&dp_endpoint).await.unwrap();
        let mut stream = dp::device_plugin_client::DevicePluginClient::new(channel)
            .list_and_watch(dp::Empty {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(stream.message().await.unwrap().unwrap().devices.len(), 8);
        drop(stream);
        let channel = gpuplane_node::grpc::connect(&dra_endpoint).await.unwrap();
        let mut stream = health::dra_resource_health_client::DraResourceHealthClient::new(channel)
            .node_watch_resources(health::NodeWatchResourcesRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(stream.message().await.unwrap().unwrap().devices.len(), 8);
    }
    node.xid(3).await; // the kubelet's own stream still follows
}

/// Garbage device IDs get clear errors.
async fn garbage_device_ids_get_clear_errors(node: &Node) {
    // Garbage device IDs.
    let err = node
        .kubelet
        .allocate(GPU, &["GPU-nope".into(), String::new()])
        .await
        .unwrap_err();
    assert!(err.message().contains("GPU-nope"), "{}", err.message());
    let err = node
        .kubelet
        .preferred(GPU, &["GPU-nope".into()], &["../x".into()], 1)
        .await;
    assert!(err.is_err(), "{err:?}");
}

/// Garbage claims, with one good claim in the same request, get clear errors each, and an
/// unprepare of garbage removes nothing.
async fn garbage_claims_get_clear_errors_and_undo_nothing(node: &Node) {
    // Garbage claims, with one good claim in the same request.
    let good = put_claim(&node.api, "good", &["gpu-1"]);
    let garbage = [
        ("../../etc/passwd", "team-a", "x"),
        ("", "team-a", "x"),
        ("ABCDEF", "team-a", "x"),
        ("0b5c3f2e-1111-4222-8333-444455556666", "team-a", "ghost"),
        ("0b5c3f2e-1111-4222-8333-444455556667", "team-a", "Bad/Name"),
        ("0b5c3f2e-1111-4222-8333-444455556668", "", "x"),
    ];
    let mut claims: Vec<RawClaim> = garbage
        .iter()
        .map(|(uid, ns, name)| RawClaim {
            uid: uid.to_string(),
            namespace: ns.to_string(),
            name: name.to_string(),
        })
        .collect();
    // The empty UID cannot be a map key next to another; ask it on its own below.
    let empty = claims.remove(1);
    claims.push(RawClaim::from(&good));
    let answers = node.dra.prepare(DRIVER, &claims).await.unwrap();
    for c in &claims[..claims.len() - 1] {
        let err = answers[&c.uid].as_ref().unwrap_err();
        assert!(!err.is_empty(), "{c:?}");
    }
    let ghost = answers["0b5c3f2e-1111-4222-8333-444455556666"]
        .as_ref()
        .unwrap_err();
    assert!(ghost.contains("team-a/ghost"), "{ghost}");
    assert!(
        answers[good.uid.as_str()].is_ok(),
        "{:?}",
        answers[good.uid.as_str()]
    );
    let err = raw_prepare(node, &empty).await;
    assert!(!err.is_empty(), "an empty UID is refused");

    // Unprepare of garbage removes nothing.
    let specs = || {
        let mut v: Vec<String> = std::fs::read_dir(node.root().join("cdi"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let before = specs();
    let answers = node
        .dra
        .unprepare(DRIVER, &claims[..claims.len() - 1])
        .await
        .unwrap();
    // Nothing to undo is success (the kubelet would retry an error for ever); a request
    // the shell cannot take is refused on its own.
    for (uid, answer) in &answers {
        match uid.as_str() {
            "0b5c3f2e-1111-4222-8333-444455556668" => {
                assert!(
                    answer.as_ref().is_err_and(|e| e.contains("namespace")),
                    "{answer:?}"
                )
            }
            _ => assert!(answer.is_ok(), "{uid}: {answer:?}"),
        }
    }
    assert_eq!(specs(), before);
}

/// NodePrepareResources over v1 for one claim, straight on the socket; the per-claim error.
async fn raw_prepare(node: &Node, c: &RawClaim) -> String {
    let endpoint = node.dra.plugin(DRIVER).unwrap().endpoint;
    let channel = gpuplane_node::grpc::connect(&endpoint).await.unwrap();
    let resp = v1::dra_plugin_client::DraPluginClient::new(channel)
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1::Claim {
                namespace: c.namespace.to_string(),
                uid: c.uid.to_string(),
                name: c.name.to_string(),
            }],
        })
        .await;
    match resp {
        Ok(r) => r
            .into_inner()
            .claims
            .get(c.uid.as_str())
            .map(|r| r.error.clone())
            .unwrap_or_else(|| "no answer for the claim".into()),
        Err(s) => s.message().to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvml_failing_at_start_up_is_retried_then_the_gpus_that_answer_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libnvidia-ml.so.1");
    std::fs::copy(support::built_fake(), &lib).unwrap();
    let control = dir.path().join("control");
    // The driver is not loaded yet; GPU 3 will have fallen off the bus.
    std::fs::write(&control, "init-fail\nlose 3\n").unwrap();
    let api = ApiServerDouble::start().await.unwrap();
    let kubelet = KubeletDouble::start(&dir.path().join("kubelet"))
        .await
        .unwrap();
    let dra = KubeletDraDouble::start(&dir.path().join("kubelet"), KubeletDraOptions::default());
    support::lay_out_node(dir.path(), 8, &api.url());
    let mut agent = AgentProcess::spawn(
        dir.path(),
        "",
        &[
            "--nvml-lib",
            lib.to_str().unwrap(),
            "--telemetry-interval",
            "100ms",
        ],
        &[
            ("GPUPLANE_FAKE_NVML_PROFILE", "dgx-h100".as_ref()),
            ("GPUPLANE_FAKE_NVML_CONTROL", control.as_os_str()),
        ],
        "nvml",
    );

    let failures = "gpuplane_discovery_failures_total";
    eventually("two failed discoveries", WAIT, || {
        agent.metric(failures).is_some_and(|n| n >= 2.0)
    })
    .await;
    assert!(agent.running(), "no crash loop:\n{}", agent.log_text());
    let (code, why) = agent.get("/readyz").unwrap();
    assert_eq!(code, 503);
    assert!(
        why.contains("devices not discovered yet") && why.contains("driver is not loaded"),
        "{why}"
    );
    assert_eq!(agent.get("/healthz").map(|(c, _)| c), Some(200));
    assert!(kubelet.plugins().is_empty() && dra.registered_drivers().is_empty());

    // The driver comes up: the seven GPUs that answer are served through both APIs.
    writeln!(
        std::fs::OpenOptions::new()
            .append(true)
            .open(&control)
            .unwrap(),
        "init-ok"
    )
    .unwrap();
    kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 7))
        .await
        .unwrap();
    dra.wait_registered(DRIVER, WAIT).await.unwrap();
    let devices = || {
        api.list_json("resource.k8s.io/v1", "resourceslices", None)
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .map(|d| d["name"].as_str().unwrap_or_default().to_string())
            .collect::<Vec<String>>()
    };
    eventually("seven published GPUs", WAIT, || devices().len() == 7).await;
    assert!(!devices().contains(&"gpu-3".to_string()));
    eventually("ready", WAIT, || {
        agent.get("/readyz").is_some_and(|(c, _)| c == 200)
    })
    .await;
    // GPU 3 answers again: rediscovered, served, and sampled by a thread started for it.
    let gpu3 = gpuplane_model::sim::load("dgx-h100").unwrap().gpus[3]
        .uuid
        .to_string();
    let sampled = || {
        let (_, text) = agent.get("/metrics").unwrap_or_default();
        gpuplane_testkit::metrics_text::series(&text, "gpuplane_device_up")
            .iter()
            .any(|(l, v)| l["uuid"] == gpu3 && *v == 1.0)
    };
    assert!(!sampled(), "GPU 3 was lost at start");
    writeln!(
        std::fs::OpenOptions::new()
            .append(true)
            .open(&control)
            .unwrap(),
        "restore 3"
    )
    .unwrap();
    kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 8))
        .await
        .unwrap();
    eventually("GPU 3's telemetry", WAIT, sampled).await;
    assert!(agent.running());
    agent.kill();
}
