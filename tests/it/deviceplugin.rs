//! The device plugin end to end: the real agent (in process, simulated hardware) serving a
//! kubelet double over unix sockets in a temp dir; and the agent binary on the fake
//! libnvidia-ml (real hardware from its point of view) with device nodes in a temp dir.

use crate::support;
use crate::support::eventually;

use gpuplane_model::inventory::DeviceUuid;
use gpuplane_model::source::{DeviceMode, DeviceSource, SimSource};
use gpuplane_node::node::NodeOptions;
use gpuplane_node::paths::HostPaths;
use gpuplane_testkit::doubles::kubelet::{KubeletDouble, PluginView};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(10);
const GPU: &str = "nvidia.com/gpu";

struct Harness {
    dir: tempfile::TempDir,
    kubelet: KubeletDouble,
    sim: SimSource,
    stop: Option<oneshot::Sender<()>>,
    agent: JoinHandle<Result<(), gpuplane_node::node::NodeError>>,
    /// Where the agent serves `/metrics`, if it was started to.
    metrics: Option<SocketAddr>,
}

fn options(dir: &Path, config: Option<&str>, device_mode: DeviceMode) -> NodeOptions {
    let config_file = config.map(|text| {
        let p = dir.join("config.yaml");
        std::fs::write(&p, text).unwrap();
        p
    });
    NodeOptions {
        node_name: "node-a".into(),
        paths: HostPaths {
            kubelet_root: dir.join("kubelet"),
            cdi_root: dir.join("cdi"),
            state_dir: dir.join("state"),
            driver_root: dir.join("driver"),
            driver_root_mount: None,
            dev_root: dir.join("dev"),
            ..HostPaths::standard()
        },
        config_file,
        sharing_switch: None,
        device_plugin: true,
        dra: None,
        api: None,
        metrics_addr: None,
        device_mode,
        telemetry: None,
    }
}

/// The agent on a simulated machine, as `gpuplane node --simulate` runs it.
async fn start(profile: &str, config: Option<&str>) -> Harness {
    start_as(profile, config, DeviceMode::Simulated).await
}

/// [`start`], also serving `/metrics` (see [`Harness::metric`]).
async fn start_serving(profile: &str, config: Option<&str>) -> Harness {
    let metrics: SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
    start_with(profile, config, DeviceMode::Simulated, Some(metrics)).await
}

async fn start_as(profile: &str, config: Option<&str>, mode: DeviceMode) -> Harness {
    start_with(profile, config, mode, None).await
}

async fn start_with(
    profile: &str,
    config: Option<&str>,
    mode: DeviceMode,
    metrics: Option<SocketAddr>,
) -> Harness {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletDouble::start(&dir.path().join("kubelet"))
        .await
        .unwrap();
    let sim = SimSource::new(gpuplane_model::sim::load(profile).unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let opts = NodeOptions {
        metrics_addr: metrics,
        ..options(dir.path(), config, mode)
    };
    let source: Arc<dyn DeviceSource> = Arc::new(sim.clone());
    let agent = tokio::spawn(gpuplane_node::node::run(opts, source, async {
        let _ = stopped.await;
    }));
    Harness {
        dir,
        kubelet,
        sim,
        stop: Some(stop),
        agent,
        metrics,
    }
}

impl Harness {
    async fn wait(
        &self,
        what: &str,
        check: impl Fn(&BTreeMap<String, PluginView>) -> bool,
    ) -> BTreeMap<String, PluginView> {
        self.kubelet
            .wait_for(WAIT, check)
            .await
            .unwrap_or_else(|e| panic!("waiting for {what}: {e}"))
    }

    async fn wait_devices(&self, resource: &str, n: usize) -> PluginView {
        let r = resource.to_string();
        self.wait(&format!("{n} devices of {resource}"), move |p| {
            p.get(&r).is_some_and(|v| v.devices.len() == n)
        })
        .await[resource]
            .clone()
    }

    async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.agent.await.unwrap().unwrap();
        self.kubelet.stop().await;
    }

    fn gpu_uuid(&self, i: usize) -> DeviceUuid {
        self.sim.discover().unwrap().inventory.gpus[i].uuid.clone()
    }

    /// One sample of the agent's `/metrics` (it must have been started by [`start_serving`]);
    /// `None` while the agent does not answer.
    async fn metric(&self, sample: &str) -> Option<f64> {
        let addr = self.metrics.expect("an agent started by start_serving");
        let sample = sample.to_string();
        tokio::task::spawn_blocking(move || {
            let (_, body) = support::http_get(addr, "/metrics")?;
            support::metric_value(&body, &sample)
        })
        .await
        .unwrap()
    }

    /// Waits until `/metrics` shows `sample` above `floor`.
    async fn wait_metric_above(&self, sample: &str, floor: f64) {
        let deadline = std::time::Instant::now() + WAIT;
        while self.metric(sample).await.is_none_or(|v| v <= floor) {
            assert!(
                std::time::Instant::now() < deadline,
                "{sample} never rose above {floor}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Replaces the agent's config file in one step (a rename, as a ConfigMap update does), so the
/// agent never reads it half-written.
fn write_config(dir: &Path, text: &str) {
    let tmp = dir.join("config.yaml.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join("config.yaml")).unwrap();
}

/// Gone, or disconnected (the kubelet then counts none of its devices as healthy).
fn withdrawn(p: &BTreeMap<String, PluginView>, resource: &str) -> bool {
    p.get(resource).is_none_or(|v| v.healthy() == 0)
}

fn ids(v: &PluginView) -> Vec<String> {
    v.devices.iter().map(|d| d.id.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_registers_and_lists_every_gpu_with_its_numa_node() {
    let h = start("dgx-h100", None).await;
    let view = h.wait_devices(GPU, 8).await;
    assert_eq!(view.healthy(), 8);
    let numa: Vec<i64> = view
        .devices
        .iter()
        .map(|d| d.topology.as_ref().unwrap().nodes[0].id)
        .collect();
    assert_eq!(numa, [0, 0, 0, 0, 1, 1, 1, 1]);
    assert!(view.options.unwrap().get_preferred_allocation_available);
    let reg = h.kubelet.registrations();
    assert_eq!(reg.len(), 1);
    assert_eq!(
        (reg[0].version.as_str(), reg[0].endpoint.as_str()),
        ("v1beta1", "gpuplane-nvidia.com_gpu.sock")
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_returns_cdi_names_and_refuses_unknown_devices() {
    let h = start("pcie-l4x4", None).await;
    let view = h.wait_devices(GPU, 4).await;
    let grant = h
        .kubelet
        .allocate(GPU, &[view.devices[1].id.clone()])
        .await
        .unwrap();
    assert_eq!(grant.cdi_devices.len(), 1);
    assert_eq!(
        grant.cdi_devices[0].name,
        format!("nvidia.com/gpu={}", h.gpu_uuid(1))
    );
    // Simulated: the node spec was written without device nodes, and NVIDIA_VISIBLE_DEVICES
    // comes from Allocate, which knows the container's whole set.
    assert!(h.dir.path().join("cdi/gpuplane-node.json").is_file());
    assert_eq!(
        grant.envs,
        [(
            "NVIDIA_VISIBLE_DEVICES".to_string(),
            h.gpu_uuid(1).to_string()
        )]
        .into()
    );
    let both = [view.devices[3].id.clone(), view.devices[0].id.clone()];
    let grant = h.kubelet.allocate(GPU, &both).await.unwrap();
    assert_eq!(
        grant.envs["NVIDIA_VISIBLE_DEVICES"],
        format!("{},{}", h.gpu_uuid(3), h.gpu_uuid(0))
    );
    let err = h
        .kubelet
        .allocate(GPU, &["GPU-not-mine".into()])
        .await
        .unwrap_err();
    assert!(
        err.message()
            .contains("GPU-not-mine is not a nvidia.com/gpu device"),
        "{}",
        err.message()
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envvar_and_index_strategies_fill_nvidia_visible_devices() {
    let h = start(
        "pcie-l4x4",
        Some("flags: {plugin: {deviceListStrategy: envvar, deviceIDStrategy: index}}"),
    )
    .await;
    h.wait_devices(GPU, 4).await;
    let grant = h
        .kubelet
        .allocate(GPU, &["2".into(), "3".into()])
        .await
        .unwrap();
    assert_eq!(
        grant.envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str),
        Some("2,3")
    );
    assert!(grant.cdi_devices.is_empty());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_on_the_cube_mesh_picks_nvlink_pairs() {
    let h = start(
        "dgx1-v100",
        Some("flags: {plugin: {deviceIDStrategy: index}}"),
    )
    .await;
    let view = h.wait_devices(GPU, 8).await;
    let all = ids(&view);
    let pair = h.kubelet.preferred(GPU, &all, &[], 2).await.unwrap();
    let inv = gpuplane_model::sim::load("dgx1-v100").unwrap();
    let (a, b): (u32, u32) = (pair[0].parse().unwrap(), pair[1].parse().unwrap());
    assert_eq!(inv.topology.link(a, b).unwrap().nvlinks, 2, "{pair:?}");
    // must_include is honoured and only offered devices come back.
    let offered: Vec<String> = ["1", "4", "5", "6"].map(String::from).to_vec();
    let got = h
        .kubelet
        .preferred(GPU, &offered, &["4".into()], 2)
        .await
        .unwrap();
    assert!(
        got.contains(&"4".to_string()) && got.iter().all(|d| offered.contains(d)),
        "{got:?}"
    );
    // 4-5 and 4-6 both have one NVLink; 4-5 share a PCIe switch.
    assert_eq!(got, ["4", "5"]);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_restart_gets_every_resource_registered_again() {
    let mut h = start("a100-mig-mixed", Some("flags: {migStrategy: mixed}")).await;
    h.wait("7 resources", |p| p.len() == 7).await;
    let before = h.kubelet.registrations().len();
    h.kubelet.restart().await.unwrap();
    let after = h
        .wait("7 resources after restart", |p| {
            p.len() == 7 && p.values().all(|v| v.updates > 0)
        })
        .await;
    assert_eq!(h.kubelet.registrations().len(), before + 7);
    assert_eq!(after["nvidia.com/mig-1g.5gb"].devices.len(), 3);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_before_the_kubelet_registers_once_it_appears() {
    let dir = tempfile::tempdir().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let source: Arc<dyn DeviceSource> = Arc::new(SimSource::new(
        gpuplane_model::sim::load("pcie-l4x4").unwrap(),
    ));
    let agent = tokio::spawn(gpuplane_node::node::run(
        options(dir.path(), None, DeviceMode::Simulated),
        source,
        async {
            let _ = stopped.await;
        },
    ));
    // The agent got as far as serving its plugin socket, with no kubelet to register with.
    let socket = dir
        .path()
        .join("kubelet/device-plugins")
        .join(gpuplane_node::deviceplugin::registrar::socket_name(GPU));
    eventually(
        "the plugin socket served before the kubelet exists",
        WAIT,
        || socket.exists() || agent.is_finished(),
    )
    .await;
    assert!(
        !agent.is_finished(),
        "the agent must wait for the kubelet, not exit"
    );
    let mut kubelet = KubeletDouble::start(&dir.path().join("kubelet"))
        .await
        .unwrap();
    kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.devices.len() == 4))
        .await
        .unwrap();
    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_strategy_single_offers_56_mig_devices_as_gpus() {
    let h = start("h100-mig-single", Some("flags: {migStrategy: single}")).await;
    let view = h.wait_devices(GPU, 56).await;
    assert!(view.devices.iter().all(|d| d.id.starts_with("MIG-")));
    let grant = h
        .kubelet
        .allocate(GPU, &[view.devices[9].id.clone()])
        .await
        .unwrap();
    assert_eq!(
        grant.cdi_devices[0].name,
        format!("nvidia.com/gpu={}", view.devices[9].id)
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_sliced_replicas_are_spread_over_distinct_gpus_and_limited_per_container() {
    let cfg = "sharing: {timeSlicing: {renameByDefault: true, failRequestsGreaterThanOne: true, resources: [{name: nvidia.com/gpu, replicas: 4}]}}";
    let h = start("pcie-l4x4", Some(cfg)).await;
    let view = h.wait_devices("nvidia.com/gpu.shared", 16).await;
    let all = ids(&view);
    let picked = h
        .kubelet
        .preferred("nvidia.com/gpu.shared", &all, &[], 3)
        .await
        .unwrap();
    let gpus: std::collections::BTreeSet<&str> = picked
        .iter()
        .map(|id| id.split("::").next().unwrap())
        .collect();
    assert_eq!(
        gpus.len(),
        3,
        "replicas must land on distinct GPUs: {picked:?}"
    );
    let err = h
        .kubelet
        .allocate("nvidia.com/gpu.shared", &picked[..2])
        .await
        .unwrap_err();
    assert!(
        err.message().contains("limited to 1 replica per container"),
        "{}",
        err.message()
    );
    assert!(h
        .kubelet
        .allocate("nvidia.com/gpu.shared", &picked[..1])
        .await
        .is_ok());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_makes_a_device_unhealthy_and_it_recovers_after_the_quiet_period() {
    let h = start("dgx-h100", Some("health: {recoveryQuietPeriod: 500ms}")).await;
    h.wait_devices(GPU, 8).await;
    let uuid = h.gpu_uuid(3);
    h.sim.inject_xid(&uuid, None, 13); // skipped by default: nothing changes
    h.sim.inject_xid(&uuid, None, 48);
    let u = uuid.clone();
    let view = h
        .wait("GPU 3 unhealthy", move |p| {
            p[GPU]
                .devices
                .iter()
                .any(|d| d.id == u && d.health == "Unhealthy")
        })
        .await;
    assert_eq!(view[GPU].healthy(), 7);
    let err = h
        .kubelet
        .allocate(GPU, &[uuid.to_string()])
        .await
        .unwrap_err();
    assert!(
        err.message().contains("unhealthy (critical Xid 48)"),
        "{}",
        err.message()
    );
    h.wait("GPU 3 recovered", |p| p[GPU].healthy() == 8).await;
    assert!(h.kubelet.allocate(GPU, &[uuid.to_string()]).await.is_ok());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_gpu_is_unhealthy_alone_and_the_others_stay_allocatable() {
    let h = start(
        "dgx-h100",
        Some("health: {inventoryRefresh: 200ms, recoveryQuietPeriod: 1h}"),
    )
    .await;
    let view = h.wait_devices(GPU, 8).await;
    let lost = h.gpu_uuid(2);
    h.sim.set_lost(&lost, true);
    let l = lost.clone();
    h.wait("GPU 2 unhealthy", move |p| {
        p[GPU]
            .devices
            .iter()
            .any(|d| d.id == l && d.health == "Unhealthy")
    })
    .await;
    // Past an inventory refresh that no longer sees the GPU, it stays listed. The refresh: one
    // that began after the GPU was lost, seen handed to the state owner (the next one began).
    // Then an Xid on GPU 5, which the owner applies after that refresh: once ListAndWatch shows
    // it, what ListAndWatch shows includes the refresh.
    let marker = h.gpu_uuid(5);
    let discoveries = h.sim.discoveries();
    eventually("a refresh that saw GPU 2 lost", WAIT, || {
        h.sim.discoveries() >= discoveries + 2
    })
    .await;
    h.sim.inject_xid(&marker, None, 48);
    let m = marker.clone();
    let now = h
        .wait("GPU 5 unhealthy after the refresh", move |p| {
            p[GPU]
                .devices
                .iter()
                .any(|d| d.id == m && d.health == "Unhealthy")
        })
        .await[GPU]
        .clone();
    assert_eq!((now.devices.len(), now.healthy()), (8, 6));
    let others: Vec<String> = ids(&view)
        .into_iter()
        .filter(|id| *id != lost && *id != marker)
        .collect();
    let pick = h.kubelet.preferred(GPU, &others, &[], 4).await.unwrap();
    assert!(h.kubelet.allocate(GPU, &pick).await.is_ok());
    assert!(h.kubelet.allocate(GPU, &[lost.to_string()]).await.is_err());
    h.sim.set_lost(&lost, false);
    // GPU 5 stays unhealthy: its quiet period is an hour.
    h.wait("GPU 2 back", |p| p[GPU].healthy() == 7).await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_reconfiguration_is_picked_up_without_a_restart() {
    let h = start(
        "a100-mig-mixed",
        Some("flags: {migStrategy: mixed}\nhealth: {inventoryRefresh: 200ms}"),
    )
    .await;
    h.wait_devices("nvidia.com/mig-4g.20gb", 1).await;
    let mut inv = gpuplane_model::sim::load("a100-mig-mixed").unwrap();
    let mut seven = gpuplane_model::sim::load("h100-mig-single").unwrap().gpus[0]
        .mig_devices
        .clone();
    for (i, m) in seven.iter_mut().enumerate() {
        m.parent_uuid = inv.gpus[1].uuid.clone();
        m.uuid = DeviceUuid::parse(format!("MIG-00000000-0000-0000-0000-00000000000{i}")).unwrap();
    }
    inv.gpus[1].mig_devices = seven;
    h.sim.set_inventory(inv);
    h.wait(
        "the new 1g.10gb devices and the old 4g.20gb withdrawn",
        |p| {
            p.get("nvidia.com/mig-1g.10gb")
                .is_some_and(|v| v.devices.len() == 8)
                && withdrawn(p, "nvidia.com/mig-4g.20gb")
        },
    )
    .await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_change_is_applied_without_dropping_unchanged_registrations() {
    let h = start_serving("a100-mig-mixed", Some("flags: {migStrategy: mixed}")).await;
    h.wait("7 resources", |p| p.len() == 7).await;
    let count = |r: &str| {
        h.kubelet
            .registrations()
            .iter()
            .filter(|x| x.resource_name == r)
            .count()
    };
    write_config(
        h.dir.path(),
        "flags: {migStrategy: mixed}\nsharing: {timeSlicing: {resources: [{name: nvidia.com/mig-1g.5gb, replicas: 2, rename: nvidia.com/mig-1g.5gb.shared}]}}\n",
    );
    h.wait_devices("nvidia.com/mig-1g.5gb.shared", 6).await;
    h.wait("the unshared name withdrawn", |p| {
        withdrawn(p, "nvidia.com/mig-1g.5gb")
    })
    .await;
    assert_eq!(
        count("nvidia.com/mig-3g.20gb"),
        1,
        "unchanged resources keep their registration"
    );
    // A broken file keeps the running config: once the agent counts it read and refused (the
    // count goes up before any change would reach the kubelet), nothing changed.
    let applied = "gpuplane_config_reloads_total{outcome=\"applied\"}";
    let refused = "gpuplane_config_reloads_total{outcome=\"refused\"}";
    let applied_before = h.metric(applied).await;
    assert_eq!(applied_before, Some(1.0), "the good file was read once");
    let refused_before = h.metric(refused).await.unwrap();
    write_config(h.dir.path(), "flags: {migStrategy: sideways}\n");
    h.wait_metric_above(refused, refused_before).await;
    assert_eq!(
        h.metric(applied).await,
        applied_before,
        "a broken file applied"
    );
    assert_eq!(
        h.kubelet
            .plugin("nvidia.com/mig-1g.5gb.shared")
            .unwrap()
            .devices
            .len(),
        6
    );
    assert_eq!(count("nvidia.com/mig-3g.20gb"), 1);
    h.shutdown().await;
}

/// Fails under CI, skips (returning true) elsewhere, where this process cannot mknod.
fn cannot_make_nodes() -> bool {
    if gpuplane_testkit::doubles::devnodes::can_make_nodes() {
        return false;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "making device nodes (mknod) needs root; CI runs as root"
    );
    eprintln!("SKIPPED: making device nodes (mknod) needs root");
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cdi_spec_is_written_only_once_the_device_nodes_exist() {
    if cannot_make_nodes() {
        return;
    }
    let h = start_as("pcie-l4x4", None, DeviceMode::Hardware).await;
    h.wait_devices(GPU, 4).await;
    let spec_path = h.dir.path().join("cdi/gpuplane-node.json");
    // Allocate makes the agent try to write the spec (it hands out no name whose spec is not
    // written), the same way its spec keeper does: refused, and no spec.
    let err = h
        .kubelet
        .allocate(GPU, &[h.gpu_uuid(0).to_string()])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("is not written"),
        "{}",
        err.message()
    );
    assert!(
        !spec_path.exists(),
        "no spec may be cached before /dev/nvidia* exist"
    );
    let dev = h.dir.path().join("dev");
    gpuplane_testkit::doubles::devnodes::make_gpu_nodes(&dev, 0..4).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while !spec_path.exists() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_path).expect("spec written")).unwrap();
    assert_eq!(spec["kind"], "nvidia.com/gpu");
    let names: Vec<&str> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["name"].as_str())
        .collect();
    assert!(
        names.contains(&h.gpu_uuid(2).as_str()) && names.contains(&"0") && names.contains(&"all"),
        "{names:?}"
    );
    h.shutdown().await;
}

/// The agent binary on the fake libnvidia-ml: real hardware as far as it knows. Allocate must
/// not hand out a CDI name whose spec is not written; it refuses naming the device nodes that
/// are missing or wrong (as NodePrepare does), and the kubelet's retry succeeds once they are
/// right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_nvml_allocate_refuses_until_the_device_nodes_are_right() {
    if cannot_make_nodes() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let lib = root.join("libnvidia-ml.so.1");
    std::fs::copy(support::built_fake(), &lib).unwrap();
    let api = gpuplane_testkit::doubles::apiserver::ApiServerDouble::start()
        .await
        .unwrap();
    let kubelet = KubeletDouble::start(&root.join("kubelet")).await.unwrap();
    let inv = gpuplane_model::sim::load("pcie-l4x4").unwrap();
    support::lay_out_node(root, inv.gpus.len(), &api.url());
    // The driver is half-way: GPU 1's node is not there yet, a stray file sits where GPU 0's
    // must be, and GPU 3's has GPU 7's number.
    let dev = root.join("dev");
    let node = |i: usize| dev.join(format!("nvidia{}", inv.gpus[i].minor));
    std::fs::remove_file(node(1)).unwrap();
    std::fs::remove_file(node(0)).unwrap();
    std::fs::write(node(0), "").unwrap();
    gpuplane_testkit::doubles::devnodes::make_node(&node(3), 195, 7).unwrap();
    let agent = support::AgentProcess::spawn(
        root,
        "",
        &["--nvml-lib", lib.to_str().unwrap()],
        &[("GPUPLANE_FAKE_NVML_PROFILE", "pcie-l4x4".as_ref())],
        "nvml",
    );
    let view = kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.devices.len() == 4))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log_text()))[GPU]
        .clone();
    let gpu2 = inv.gpus[2].uuid.to_string();
    assert!(view.devices.iter().any(|d| d.id == gpu2));

    let err = kubelet
        .allocate(GPU, std::slice::from_ref(&gpu2))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let msg = err.message();
    for reason in [
        format!("{} does not exist yet", node(1).display()),
        format!(
            "{} is a regular file, not a character device",
            node(0).display()
        ),
        format!(
            "{} has device number 195:7, expected 195:{}",
            node(3).display(),
            inv.gpus[3].minor
        ),
    ] {
        assert!(msg.contains(&reason), "{reason} not in: {msg}");
    }
    let spec_path = root.join("cdi/gpuplane-node.json");
    assert!(!spec_path.exists(), "no spec names a bad node");

    // The driver finishes; the kubelet's retry is granted, with a name the written spec defines.
    for i in [0, 1, 3] {
        gpuplane_testkit::doubles::devnodes::make_node(&node(i), 195, u64::from(inv.gpus[i].minor))
            .unwrap();
    }
    let grant = kubelet
        .allocate(GPU, std::slice::from_ref(&gpu2))
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", agent.log_text()));
    let name = format!("nvidia.com/gpu={gpu2}");
    assert_eq!(
        grant
            .cdi_devices
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>(),
        [name.as_str()]
    );
    assert!(grant.envs.is_empty(), "{:?}", grant.envs);
    let spec: gpuplane_node::cdi::Spec =
        serde_json::from_slice(&std::fs::read(&spec_path).expect("spec written")).unwrap();
    let device = spec
        .devices
        .iter()
        .find(|d| d.name == gpu2)
        .expect("the granted device is in the spec");
    let host = node(2).display().to_string();
    assert_eq!(
        device.container_edits.device_nodes[0].host_path.as_deref(),
        Some(host.as_str())
    );
    assert!(spec
        .container_edits
        .env
        .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string()));
    agent.kill();
}
