//! Device telemetry, end to end: the real agent binary over the fake libnvidia-ml, whose
//! telemetry file says what each device and PID does; the pods in the API server double; a
//! host /proc laid out by the test (each PID's cgroup names its pod UID and container ID); and
//! /metrics scraped over HTTP. Each case proves a reading lands on the pod that holds the
//! device: through the device plugin API, through a claim, as one of two shares of a GPU (MPS
//! clients, not their server), on a MIG device, across an agent restart, and that a device
//! which fails or stalls is reported down without holding up an Allocate.

// The real binary over the fake NVML, on the crash tests' node (tests/support/crash_node.rs,
// built with the suite's `crashpoints` feature).
#![cfg(feature = "crashpoints")]

use crate::crash_node::{Node, WAIT};
use crate::support::{self, NODE};
use gpuplane_testkit::doubles::apiserver::ApiCall;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

const GIB: u64 = 1 << 30;
const SHARING: &str =
    "sharing:\n  consumableCapacity:\n    gpus: [0]\n    memoryStep: 1Gi\n    computeStep: 10\n";

/// A node whose agent samples every 100 ms, reads `<node>/hostproc` as the host's /proc and
/// the fake NVML's telemetry from `<node>/telemetry.json`.
async fn node(profile: &str, config: &str) -> Node {
    let mut node = Node::with_fake_nvml(profile, config).await;
    let host_proc = node.path("hostproc");
    std::fs::create_dir_all(&host_proc).unwrap();
    node.extra_args = vec![
        "--telemetry-interval".into(),
        "100ms".into(),
        "--host-proc".into(),
        host_proc.to_str().unwrap().into(),
    ];
    node.extra_env = vec![(
        "GPUPLANE_FAKE_NVML_TELEMETRY".into(),
        telemetry_file(&node).into_os_string(),
    )];
    node
}

fn telemetry_file(node: &Node) -> PathBuf {
    node.path("telemetry.json")
}

/// Replaces the telemetry file whole, as its readers expect.
fn set_telemetry(node: &Node, devices: Value) {
    let tmp = node.path("telemetry.json.tmp");
    std::fs::write(&tmp, json!({ "devices": devices }).to_string()).unwrap();
    std::fs::rename(tmp, telemetry_file(node)).unwrap();
}

/// A pod on this node with one running container, using `claims`.
struct Pod {
    namespace: &'static str,
    name: &'static str,
    container: &'static str,
    uid: String,
    container_id: String,
}

impl Pod {
    fn new(n: u8, namespace: &'static str, name: &'static str, container: &'static str) -> Pod {
        Pod {
            namespace,
            name,
            container,
            uid: format!("7d3e1c2a-0000-4000-8000-0000000000{n:02x}"),
            container_id: format!("{n:02x}").repeat(32),
        }
    }

    fn store(&self, node: &Node, claims: &[&str]) {
        let claim_refs: Vec<Value> = claims
            .iter()
            .map(|c| json!({"name": c, "resourceClaimName": c}))
            .collect();
        node.api
            .put_json(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid},
                "spec": {"nodeName": NODE, "containers": [{"name": self.container, "image": "cuda"}],
                         "resourceClaims": claim_refs},
                "status": {"phase": "Running", "containerStatuses": [{
                    "name": self.container, "containerID": format!("containerd://{}", self.container_id),
                    "image": "cuda", "imageID": "", "ready": true, "restartCount": 0}]}
            }))
            .unwrap();
    }

    /// Process `pid` runs in this pod's container (cgroupfs layout).
    fn runs(&self, node: &Node, pid: u32) {
        let dir = node.path(&format!("hostproc/{pid}"));
        std::fs::create_dir_all(&dir).unwrap();
        let cgroup = format!(
            "0::/kubepods/besteffort/pod{}/{}\n",
            self.uid, self.container_id
        );
        std::fs::write(dir.join("cgroup"), cgroup).unwrap();
    }
}

/// The series of `family` on the agent's /metrics: labels → value.
fn series(node: &Node, family: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let addr = node.agent.as_ref().expect("an agent runs").metrics;
    let Some((200, body)) = support::http_get(addr, "/metrics") else {
        return Vec::new();
    };
    gpuplane_testkit::metrics_text::series(&body, family)
}

/// The value of `family`'s series for device `uuid` whose labels include `want`.
fn value(node: &Node, family: &str, uuid: &str, want: &[(&str, &str)]) -> Option<f64> {
    series(node, family).into_iter().find_map(|(labels, v)| {
        let matches = labels.get("uuid").map(String::as_str) == Some(uuid)
            && want
                .iter()
                .all(|(k, w)| labels.get(*k).map(String::as_str) == Some(*w));
        matches.then_some(v)
    })
}

/// Waits until `family{uuid, want…}` reads `expected`.
async fn wait_value(node: &Node, family: &str, uuid: &str, want: &[(&str, &str)], expected: f64) {
    let at = |v: Option<f64>| v.is_some_and(|v| (v - expected).abs() < 1e-9);
    let seen = tokio::time::timeout(WAIT, async {
        while !at(value(node, family, uuid, want)) {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    let rows: Vec<_> = [family, UP]
        .into_iter()
        .flat_map(|f| series(node, f))
        .filter(|(l, _)| l.get("uuid").map(String::as_str) == Some(uuid))
        .collect();
    assert!(
        seen.is_ok(),
        "{family} of {uuid} with {want:?} never read {expected}; its series: {rows:?}\n{}",
        node.log()
    );
}

/// A claim in `team-a` for `share_id` of gpu-0 (time-sliced: the node has no MPS control
/// program, so no daemon runs; the fake NVML still lists the processes as MPS clients).
fn share_claim(node: &Node, name: &str, share_id: &str) -> gpuplane_node::dra::ClaimRef {
    let stored = node
        .api
        .put_json(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                "deviceClassName": "gpu.gpuplane.dev", "count": 1,
                "capacity": {"requests": {"memory": "10Gi", "compute": "30"}}}}]}},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpus", "driver": support::DRIVER, "pool": NODE, "device": "gpu-0",
                "shareID": share_id, "consumedCapacity": {"memory": "10Gi", "compute": "30"}}]}}}
        }))
        .unwrap();
    let uid = stored["metadata"]["uid"].as_str().unwrap();
    gpuplane_node::dra::ClaimRef::parse("team-a", uid, name).unwrap()
}

const UTIL: &str = "gpuplane_device_gpu_utilization_ratio";
const MEMORY: &str = "gpuplane_container_gpu_memory_used_bytes";
const BUSY: &str = "gpuplane_container_gpu_utilization_ratio";
const UP: &str = "gpuplane_device_up";

/// The GPUs of the first case: held through the device plugin, by a claim, shared by two
/// claims, and held by no one.
struct Gpus {
    dp: String,
    whole: String,
    shared: String,
    idle: String,
}

/// Holds GPUs of `node` four ways, stores the holding pods, lays out their processes in the
/// host /proc and says what each runs.
async fn hold_four_ways(node: &Node) -> Gpus {
    // Two pods get a share each of GPU 0 through claims...
    let (s1, s2) = (
        share_claim(node, "share-1", "s1"),
        share_claim(node, "share-2", "s2"),
    );
    node.prepare(&s1).await.unwrap();
    node.prepare(&s2).await.unwrap();
    // ...a container a GPU through the device plugin API, another a whole GPU through a claim.
    let (ids, _) = node
        .kubelet
        .admit("team-a", "trainer", "main", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    let dp = ids[0].clone();
    let whole_index = (1..8).find(|i| node.uuids[*i] != dp).unwrap();
    let whole = node.uuids[whole_index].clone();
    node.prepare(&node.claim("whole", &[whole_index]))
        .await
        .unwrap();
    let idle = (1..8)
        .map(|i| node.uuids[i].clone())
        .find(|u| *u != dp && *u != whole)
        .unwrap();
    let gpus = Gpus {
        dp,
        whole,
        shared: node.uuids[0].clone(),
        idle,
    };
    let pods = [
        (Pod::new(1, "team-a", "trainer", "main"), None, 101),
        (
            Pod::new(2, "team-a", "whole-user", "app"),
            Some("whole"),
            102,
        ),
        (
            Pod::new(3, "team-a", "share-one", "c"),
            Some("share-1"),
            103,
        ),
        (
            Pod::new(4, "team-a", "share-two", "c"),
            Some("share-2"),
            104,
        ),
    ];
    for (pod, claim, pid) in &pods {
        pod.store(node, claim.as_slice());
        pod.runs(node, *pid);
    }
    // GPU 0 runs MPS: its server (PID 900, outside any pod) holds the clients' memory too.
    set_telemetry(
        node,
        json!({
            gpus.dp.clone(): {"gpuUtil": 90, "processes": [{"pid": 101, "memoryBytes": 3 * GIB, "smUtil": 90}]},
            gpus.whole.clone(): {"gpuUtil": 10, "processes": [{"pid": 102, "memoryBytes": GIB}]},
            gpus.shared.clone(): {"gpuUtil": 60, "mpsServerPid": 900, "processes": [
                {"pid": 103, "memoryBytes": 2 * GIB, "smUtil": 40, "mps": true},
                {"pid": 104, "memoryBytes": 5 * GIB, "smUtil": 20, "mps": true}]}
        }),
    );
    gpus
}

/// Waits until every reading of [`hold_four_ways`] is on /metrics with its holder.
async fn check_attribution(node: &Node, gpus: &Gpus, run: &str) {
    let dp = [
        ("api", "device-plugin"),
        ("namespace", "team-a"),
        ("pod", "trainer"),
        ("container", "main"),
    ];
    wait_value(node, UTIL, &gpus.dp, &dp, 0.9).await;
    wait_value(node, MEMORY, &gpus.dp, &dp, (3 * GIB) as f64).await;
    wait_value(node, BUSY, &gpus.dp, &dp, 0.9).await;
    let claim = [
        ("api", "dra"),
        ("pod", "whole-user"),
        ("claim", "whole"),
        ("share", ""),
    ];
    wait_value(node, UTIL, &gpus.whole, &claim, 0.1).await;
    let user = [("pod", "whole-user"), ("container", "app")];
    wait_value(node, MEMORY, &gpus.whole, &user, GIB as f64).await;
    // The shared GPU's own reading is no one's; each share's container gets its own part.
    wait_value(node, UTIL, &gpus.shared, &[("api", ""), ("pod", "")], 0.6).await;
    for (pod, claim, share, memory, busy) in [
        ("share-one", "share-1", "s1", 2 * GIB, 0.4),
        ("share-two", "share-2", "s2", 5 * GIB, 0.2),
    ] {
        let labels = [
            ("api", "dra"),
            ("pod", pod),
            ("container", "c"),
            ("claim", claim),
            ("share", share),
        ];
        wait_value(node, MEMORY, &gpus.shared, &labels, memory as f64).await;
        wait_value(node, BUSY, &gpus.shared, &labels, busy).await;
    }
    let memory_rows = series(node, MEMORY);
    assert!(
        memory_rows
            .iter()
            .all(|(l, v)| l["uuid"] != gpus.shared || *v < (7 * GIB) as f64),
        "the MPS server's total is charged to no one ({run}): {memory_rows:?}"
    );
    // A GPU nobody holds still reports, with no holder.
    wait_value(node, UP, &gpus.idle, &[("api", "")], 1.0).await;
    wait_value(node, UTIL, &gpus.idle, &[("pod", "")], 0.0).await;
    let holders = series(node, "gpuplane_device_holder_info");
    let mut of_shared: Vec<&str> = holders
        .iter()
        .filter(|(l, _)| l["uuid"] == gpus.shared)
        .map(|(l, _)| l["share"].as_str())
        .collect();
    of_shared.sort_unstable();
    assert_eq!(of_shared, ["s1", "s2"], "{run}: {holders:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_reading_lands_on_the_pod_holding_the_device_through_either_api_and_a_restart() {
    let mut node = node("dgx-a100", SHARING).await;
    node.start(None).await;
    let gpus = hold_four_ways(&node).await;
    check_attribution(&node, &gpus, "first run").await;
    node.kill().await;
    node.start(None).await;
    check_attribution(&node, &gpus, "after a restart").await;
}

/// Partitioned allocation mode (a static split, no device on both sides): a claim's device
/// carries its holder as in shared mode, the device plugin's its own, and a second claim on a
/// device a claim holds is refused: the ledger holds in every mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_partitioned_mode_each_apis_holds_carry_their_holder_and_none_is_handed_out_twice() {
    let mut node = node(
        "dgx-a100",
        "allocation: {mode: partitioned, draGpus: [4, 5, 6, 7]}\n",
    )
    .await;
    node.dp_devices = 4;
    node.start(None).await;
    let (ids, _) = node
        .kubelet
        .admit("team-a", "trainer", "main", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    let (dp, whole) = (ids[0].clone(), node.uuids[5].clone());
    node.prepare(&node.claim("whole", &[5])).await.unwrap();
    let pods = [
        (Pod::new(1, "team-a", "trainer", "main"), None, 101),
        (
            Pod::new(2, "team-a", "whole-user", "app"),
            Some("whole"),
            102,
        ),
    ];
    for (pod, claim, pid) in &pods {
        pod.store(&node, claim.as_slice());
        pod.runs(&node, *pid);
    }
    set_telemetry(
        &node,
        json!({
            dp.clone(): {"gpuUtil": 90, "processes": [{"pid": 101, "memoryBytes": 3 * GIB}]},
            whole.clone(): {"gpuUtil": 10, "processes": [{"pid": 102, "memoryBytes": GIB}]}
        }),
    );
    let trainer = [("api", "device-plugin"), ("pod", "trainer")];
    wait_value(&node, UTIL, &dp, &trainer, 0.9).await;
    let claim = [("api", "dra"), ("pod", "whole-user"), ("claim", "whole")];
    wait_value(&node, UTIL, &whole, &claim, 0.1).await;
    let err = node
        .prepare(&node.claim("again", &[5]))
        .await
        .expect_err("a second claim on gpu-5 is refused");
    assert!(err.contains("gpu-5") && err.contains("whole"), "{err}");
}

/// The DRA device name of device `uuid` in this node's slices.
fn device_name(node: &Node, uuid: &str) -> String {
    let slices = node
        .api
        .list_json("resource.k8s.io/v1", "resourceslices", None);
    slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["attributes"]["uuid"]["string"] == uuid)
        .and_then(|d| d["name"].as_str().map(String::from))
        .unwrap_or_else(|| panic!("no device {uuid} in {slices:?}"))
}

/// Waits until the agent published its ResourceSlices.
async fn slices_published(node: &Node) {
    support::eventually("the slices", WAIT, || {
        !node
            .api
            .list_json("resource.k8s.io/v1", "resourceslices", None)
            .is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_device_reports_to_its_pod_and_a_failing_or_stalled_device_is_down_not_dropped() {
    let mut node = node("a100-mig-mixed", "flags: {migStrategy: mixed}\n").await;
    node.dp_devices = 1;
    node.start(None).await;
    let inventory = gpuplane_model::sim::load("a100-mig-mixed").unwrap();
    let mig = |gpu: usize, i: usize| inventory.gpus[gpu].mig_devices[i].uuid.to_string();
    let (held, stalled) = (mig(0, 0), mig(1, 0));
    let failing = node.uuids[3].clone();

    slices_published(&node).await;
    let name = device_name(&node, &held);
    let claim = support::put_claim(&node.api, "mig", &[&name]);
    node.prepare(&claim).await.unwrap();
    let pod = Pod::new(5, "team-a", "mig-user", "main");
    pod.store(&node, &["mig"]);
    pod.runs(&node, 201);
    set_telemetry(
        &node,
        json!({
            held.clone(): {"processes": [{"pid": 201, "memoryBytes": 2 * GIB}]},
            failing.clone(): {"fail": true},
            stalled.clone(): {"stallMs": 600_000}
        }),
    );
    let at_mig = [
        ("api", "dra"),
        ("pod", "mig-user"),
        ("container", "main"),
        ("claim", "mig"),
        ("mig_profile", "3g.20gb"),
    ];
    wait_value(&node, MEMORY, &held, &at_mig, (2 * GIB) as f64).await;
    // The device's own readings carry the claim's pod; the container is the process's.
    let device = [
        ("api", "dra"),
        ("pod", "mig-user"),
        ("container", ""),
        ("claim", "mig"),
    ];
    wait_value(
        &node,
        "gpuplane_device_memory_used_bytes",
        &held,
        &device,
        (2 * GIB) as f64,
    )
    .await;
    assert_eq!(
        value(&node, UTIL, &held, &[]),
        None,
        "no GPM before Hopper, so no utilization on an A100's MIG device: no series, not a made-up 0"
    );
    wait_value(&node, UP, &failing, &[], 0.0).await;
    wait_value(&node, UP, &stalled, &[], 0.0).await;
    wait_value(&node, UP, &held, &[], 1.0).await;
    // While GPU 1's sampling thread is stuck in the driver, the kubelet's calls are answered.
    let (ids, _) = node
        .kubelet
        .admit("team-b", "late", "main", "nvidia.com/mig-1g.5gb", 1)
        .await
        .unwrap();
    assert_eq!(ids.len(), 1);
    let other = support::put_claim(&node.api, "other", &[&device_name(&node, &mig(2, 2))]);
    node.prepare(&other).await.unwrap();
    assert_eq!(
        value(&node, UP, &stalled, &[]),
        Some(0.0),
        "still stuck meanwhile"
    );
}

/// On Hopper a MIG device's utilization comes from GPM samples of its GPU instance, and its
/// holder's busy counter grows from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hopper_mig_devices_utilization_comes_from_gpm_and_counts_as_busy_time() {
    // GPU 2 is an H100 with two 3g.40gb devices; GPU 3, an L4, the one `nvidia.com/gpu`.
    let mut node = node("dynamic-mig-mixed", "flags: {migStrategy: mixed}\n").await;
    node.dp_devices = 1;
    node.start(None).await;
    let inventory = gpuplane_model::sim::load("dynamic-mig-mixed").unwrap();
    let held = inventory.gpus[2].mig_devices[0].uuid.to_string();
    slices_published(&node).await;
    let claim = support::put_claim(&node.api, "mig", &[&device_name(&node, &held)]);
    node.prepare(&claim).await.unwrap();
    let pod = Pod::new(6, "team-a", "mig-user", "main");
    pod.store(&node, &["mig"]);
    pod.runs(&node, 301);
    set_telemetry(
        &node,
        json!({ held.clone(): {"gpuUtil": 60, "processes": [{"pid": 301, "memoryBytes": GIB}]} }),
    );
    let holder = [("api", "dra"), ("pod", "mig-user"), ("claim", "mig")];
    wait_value(&node, UTIL, &held, &holder, 0.6).await;
    let container = [("pod", "mig-user"), ("container", "main")];
    wait_value(&node, MEMORY, &held, &container, GIB as f64).await;
    support::eventually("the MIG holder's busy seconds to grow", WAIT, || {
        value(
            &node,
            "gpuplane_container_gpu_busy_seconds_total",
            &held,
            &holder,
        )
        .is_some_and(|v| v > 0.0)
    })
    .await;
}

/// The `GpuIdle` Events in `namespace`.
fn idle_events(node: &Node, namespace: &str) -> Vec<Value> {
    node.api
        .list_json("events.k8s.io/v1", "events", Some(namespace))
        .into_iter()
        .filter(|e| e["reason"] == "GpuIdle")
        .collect()
}

/// Event creations the agent has sent so far (answered or refused).
fn event_posts(node: &Node) -> usize {
    node.api
        .api_calls()
        .iter()
        .filter(
            |c| matches!(c, ApiCall::Resource(r) if r.verb == "create" && r.resource == "events"),
        )
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_gpu_idle_for_the_window_gets_one_event_on_its_pod_even_across_a_restart() {
    let mut node = node("dgx-a100", "").await;
    node.extra_args
        .extend(["--idle-after", "1s", "--idle-below", "5"].map(String::from));
    node.start(None).await;
    // Every GPU busy until the test says what each pod does: a hold's idle clock starts at
    // its hand-out, and a slow machine could pass the window before the readings below land.
    let gpus: Vec<String> = support::eventually("the devices in /metrics", WAIT, || {
        let up = series(&node, "gpuplane_device_up");
        (!up.is_empty()).then(|| up.into_iter().map(|(l, _)| l["uuid"].clone()).collect())
    })
    .await;
    set_telemetry(
        &node,
        gpus.into_iter()
            .map(|u| (u, json!({"gpuUtil": 90})))
            .collect(),
    );
    let (idle_ids, _) = node
        .kubelet
        .admit("team-a", "sleepy", "main", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    let (busy_ids, _) = node
        .kubelet
        .admit("team-a", "busy", "main", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    let (idle_gpu, busy_gpu) = (idle_ids[0].clone(), busy_ids[0].clone());
    Pod::new(6, "team-a", "sleepy", "main").store(&node, &[]);
    Pod::new(7, "team-a", "busy", "main").store(&node, &[]);
    set_telemetry(
        &node,
        json!({
            idle_gpu.clone(): {"gpuUtil": 0, "memoryUsedBytes": 1288490189u64},
            busy_gpu.clone(): {"gpuUtil": 90}
        }),
    );
    let events = support::eventually("the idle Event", WAIT, || {
        let e = idle_events(&node, "team-a");
        (!e.is_empty()).then_some(e)
    })
    .await;
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!(e["regarding"]["kind"], "Pod", "{e}");
    assert_eq!(e["regarding"]["name"], "sleepy", "{e}");
    assert_eq!(e["regarding"]["uid"], Pod::new(6, "", "", "").uid, "{e}");
    let note = e["note"].as_str().unwrap();
    assert!(
        note.contains(&idle_gpu) && note.contains(": 0% busy, 1.2 GiB of 80.0 GiB used"),
        "{note}"
    );
    let sleepy = [("api", "device-plugin"), ("pod", "sleepy")];
    support::eventually("the idle seconds of the sleepy pod", WAIT, || {
        value(
            &node,
            "gpuplane_held_device_idle_seconds",
            &idle_gpu,
            &sleepy,
        )
        .is_some_and(|s| s >= 1.0)
    })
    .await;
    let busy = [("api", "device-plugin"), ("pod", "busy")];
    wait_value(
        &node,
        "gpuplane_held_device_idle_seconds",
        &busy_gpu,
        &busy,
        0.0,
    )
    .await;
    // A restarted agent finds the hold idle again and tries once more: refused, still one.
    let posts = event_posts(&node);
    node.kill().await;
    node.start(None).await;
    support::eventually("the restarted agent's idle Event try", WAIT, || {
        event_posts(&node) > posts
    })
    .await;
    assert_eq!(idle_events(&node, "team-a").len(), 1);
}
