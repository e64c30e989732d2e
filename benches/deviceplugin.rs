//! Device plugin benchmarks. Each figure is printed next to a floor measured in the same run on
//! the same machine, and the ratio, because shared machines are noisy:
//! - Allocate round trip over the plugin's unix socket vs a bare tonic unary RPC over the same
//!   kind of socket;
//! - GetPreferredAllocation compute time for 8, 16 and 64 GPUs vs reading the topology matrix;
//! - idle resident memory of the agent on h100-mig-single (56 MIG devices) vs the same binary
//!   serving nothing, of the binary `GPUPLANE_SHIPPED_BIN` names (benches/common/shipped.rs).
//!
//! Run: `cargo bench --bench deviceplugin` (results are kept in benches/results/).

mod common;
#[path = "common/shipped.rs"]
mod shipped;

use common::{percentiles, row};
use gpuplane_node::paths::HostPaths;

use gpuplane_model::inventory::{DeviceId, Link, PathLevel};
use gpuplane_model::source::{DeviceSource, SimSource};
use gpuplane_model::topology::{self, TopologyModel};
use gpuplane_node::deviceplugin::allocate;
use gpuplane_node::proto::deviceplugin_v1beta1 as pb;
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

const RPCS: usize = 3000;

struct Bare;

#[tonic::async_trait]
impl pb::registration_server::Registration for Bare {
    async fn register(
        &self,
        _: tonic::Request<pb::RegisterRequest>,
    ) -> Result<tonic::Response<pb::Empty>, tonic::Status> {
        Ok(tonic::Response::new(pb::Empty {}))
    }
}

async fn allocate_vs_bare_rpc() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut kubelet = KubeletDouble::start(&dir.path().join("kubelet"))
        .await
        .expect("kubelet double");
    let sim = SimSource::new(gpuplane_model::sim::load("dgx-h100").expect("profile"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let source: Arc<dyn DeviceSource> = Arc::new(sim.clone());
    let agent = tokio::spawn(gpuplane_node::node::run(
        node_options(dir.path()),
        source,
        async {
            let _ = stopped.await;
        },
    ));
    let view = kubelet
        .wait_for(Duration::from_secs(10), |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 8)
        })
        .await
        .expect("registration");
    let endpoint = view["nvidia.com/gpu"].endpoint.clone();
    let ids: Vec<String> = view["nvidia.com/gpu"]
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect();

    // Floor: a bare unary RPC on a unix socket, same runtime, same client stack.
    let mut bare = bare_server(&dir.path().join("bare.sock"), false).await;
    // The same bare RPC through `grpc::incoming` (the `:authority` rewriter every unix-socket
    // server of ours uses): what the rewriter alone costs.
    let mut rewritten = bare_server(&dir.path().join("rewritten.sock"), true).await;
    let mut plugin = pb::device_plugin_client::DevicePluginClient::new(
        gpuplane_node::grpc::connect(&endpoint)
            .await
            .expect("dial plugin"),
    );

    let mut floor = Vec::with_capacity(RPCS);
    let mut through_rewriter = Vec::with_capacity(RPCS);
    let mut alloc = Vec::with_capacity(RPCS);
    for i in 0..RPCS {
        floor.push(register_once(&mut bare).await);
        through_rewriter.push(register_once(&mut rewritten).await);
        let req = pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: vec![ids[i % 8].clone()],
            }],
        };
        let t = Instant::now();
        plugin.allocate(req).await.expect("allocate");
        alloc.push(t.elapsed());
    }
    let floor = percentiles(floor);
    row(
        &format!("Allocate round trip (1 GPU, {RPCS} calls)"),
        percentiles(alloc),
        floor,
    );
    row(
        "bare RPC through grpc::incoming (:authority rewriter)",
        percentiles(through_rewriter),
        floor,
    );
    let _ = stop.send(());
    let _ = agent.await;
    kubelet.stop().await;
}

/// The agent's options in `dir`: device plugin only, no API server.
fn node_options(dir: &std::path::Path) -> gpuplane_node::node::NodeOptions {
    gpuplane_node::node::NodeOptions {
        node_name: "bench".into(),
        paths: HostPaths {
            kubelet_root: dir.join("kubelet"),
            cdi_root: dir.join("cdi"),
            state_dir: dir.join("state"),
            driver_root: dir.join("driver"),
            driver_root_mount: None,
            dev_root: dir.join("dev"),
            ..HostPaths::standard()
        },
        config_file: None,
        sharing_switch: None,
        device_plugin: true,
        dra: None,
        api: None,
        metrics_addr: None,
        // No device nodes in the temp dir: simulated, as `--simulate` runs it.
        device_mode: gpuplane_model::source::DeviceMode::Simulated,
        telemetry: None,
    }
}

type BareClient = pb::registration_client::RegistrationClient<tonic::transport::Channel>;

/// A server of the bare RPC on `sock` (its connections through `grpc::incoming` if
/// `rewrite`), and a client dialled to it.
async fn bare_server(sock: &std::path::Path, rewrite: bool) -> BareClient {
    let listener = gpuplane_node::grpc::bind(sock).expect("bind");
    let server = tonic::transport::Server::builder()
        .add_service(pb::registration_server::RegistrationServer::new(Bare));
    if rewrite {
        tokio::spawn(server.serve_with_incoming(gpuplane_node::grpc::incoming(listener)));
    } else {
        tokio::spawn(
            server.serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
        );
    }
    pb::registration_client::RegistrationClient::new(
        gpuplane_node::grpc::connect(sock).await.expect("dial bare"),
    )
}

/// One timed bare RPC.
async fn register_once(client: &mut BareClient) -> Duration {
    let t = Instant::now();
    client
        .register(pb::RegisterRequest::default())
        .await
        .expect("bare rpc");
    t.elapsed()
}

/// `islands` NVSwitch islands of `per` GPUs; NUMA node per two islands.
fn synthetic(islands: u32, per: u32) -> TopologyModel {
    let n = islands * per;
    let mut links = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            let same_island = a / per == b / per;
            let level = if a / (2 * per) == b / (2 * per) {
                PathLevel::NumaNode
            } else {
                PathLevel::System
            };
            links.push(Link {
                from: a,
                to: b,
                nvlinks: if same_island { 18 } else { 0 },
                level,
            });
        }
    }
    TopologyModel::from_parts(n as usize, false, &links)
}

fn preferred_compute() {
    let h100 = TopologyModel::new(&gpuplane_model::sim::load("dgx-h100").expect("profile"));
    let v100 = TopologyModel::new(&gpuplane_model::sim::load("dgx1-v100").expect("profile"));
    let cases: Vec<(String, TopologyModel, usize)> = vec![
        ("8 GPUs (dgx-h100, NVSwitch), size 4".into(), h100, 4),
        ("8 GPUs (dgx1-v100, cube mesh), size 4".into(), v100, 4),
        (
            "16 GPUs (2 NVSwitch islands), size 8".into(),
            synthetic(2, 8),
            8,
        ),
        (
            "64 GPUs (8 NVSwitch islands), size 8".into(),
            synthetic(8, 8),
            8,
        ),
    ];
    for (name, model, size) in cases {
        let all: Vec<u32> = (0..model.len() as u32).collect();
        let rounds = 300;
        let mut t_pref = Vec::with_capacity(rounds);
        let mut t_floor = Vec::with_capacity(rounds);
        for r in 0..rounds {
            // Vary the available set a little so nothing is cached between calls.
            let avail: Vec<u32> = all
                .iter()
                .copied()
                .filter(|d| !(*d as usize + r).is_multiple_of(11) || all.len() <= 8)
                .collect();
            let t = Instant::now();
            let got = topology::preferred(&model, &avail, &[], size).expect("preferred");
            t_pref.push(t.elapsed());
            // Floor: scoring one set of that size (what any algorithm must do at least once).
            let t = Instant::now();
            std::hint::black_box(model.set_score(&got));
            t_floor.push(t.elapsed());
        }
        row(
            &format!("GetPreferredAllocation compute, {name}"),
            percentiles(t_pref),
            percentiles(t_floor),
        );
    }
    // The gRPC-facing wrapper adds ID mapping on top of the same computation.
    let inv = gpuplane_model::sim::load("h100-mig-single").expect("profile");
    let cfg = gpuplane_model::config::AgentConfig::parse("bench", "flags: {migStrategy: single}")
        .expect("config");
    let plan = gpuplane_node::deviceplugin::resources::plan(&inv, &cfg)
        .expect("plan")
        .resources
        .remove(0);
    let model = TopologyModel::new(&inv);
    let ids: Vec<DeviceId> = plan.devices.iter().map(|d| d.id.clone()).collect();
    let mut t = Vec::new();
    let mut f = Vec::new();
    for _ in 0..300 {
        let s = Instant::now();
        std::hint::black_box(
            allocate::preferred(&plan, &model, &ids, &[], 4, &BTreeSet::new()).expect("preferred"),
        );
        t.push(s.elapsed());
        let s = Instant::now();
        std::hint::black_box(ids.iter().filter(|i| i.starts_with("MIG-")).count());
        f.push(s.elapsed());
    }
    row(
        "GetPreferredAllocation, 56 MIG devices, size 4",
        percentiles(t),
        percentiles(f),
    );
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

async fn idle_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut kubelet = KubeletDouble::start(&dir.path().join("kubelet"))
        .await
        .expect("kubelet double");
    let cfg = dir.path().join("config.yaml");
    std::fs::write(&cfg, "flags: {migStrategy: single}\n").expect("config");
    let (bin, which) = shipped::binary();
    println!("(idle RSS of {which} binary, {bin})");
    let spawn = |device_plugin: &str| {
        std::process::Command::new(&bin)
            .args([
                "node",
                "--node-name",
                "bench",
                "--simulate",
                "h100-mig-single",
                "--config",
            ])
            .arg(&cfg)
            .arg("--kubelet-root")
            .arg(dir.path().join("kubelet"))
            // One agent per state directory: the two run side by side.
            .arg("--state-dir")
            .arg(dir.path().join(format!("state-{device_plugin}")))
            .arg(format!("--device-plugin={device_plugin}"))
            .env("RUST_LOG", "warn")
            .spawn()
            .expect("spawn agent")
    };
    let mut serving = spawn("true");
    kubelet
        .wait_for(Duration::from_secs(20), |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 56)
        })
        .await
        .expect("registration");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss = rss_kib(serving.id()).unwrap_or(0);
    let mut idle = spawn("false");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let floor = rss_kib(idle.id()).unwrap_or(0);
    println!(
        "{:<46} {rss:>7} KiB | floor (same binary, serving nothing) {floor:>7} KiB | ratio {:>4.2}x",
        "Idle RSS, h100-mig-single (56 MIG devices)",
        rss as f64 / floor.max(1) as f64
    );
    for child in [&mut serving, &mut idle] {
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let _ = child.wait();
    }
    kubelet.stop().await;
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "gpuplane device plugin benchmarks ({} logical CPUs)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    rt.block_on(allocate_vs_bare_rpc());
    preferred_compute();
    rt.block_on(idle_memory());
}
