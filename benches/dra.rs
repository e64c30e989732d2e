//! DRA driver benchmarks. Each figure is printed next to a floor measured in the same run on the
//! same machine, and the ratio, because shared machines are noisy:
//! - NodePrepareResources over the DRA plugin's unix socket (1 claim, and 8 claims in one
//!   request) vs what any prepare must do at least: GET the claim with the real kube client from
//!   the same API server double, and write one fsync'd file of the CDI spec's size into the same
//!   temp dir (NodeUnprepareResources is timed too, vs the write alone);
//! - the allocation ledger's added latency on Allocate: the same call with
//!   `allocation: {mode: shared}` (ledger enforced) vs `mode: partitioned` (the device plugin's
//!   holds learned from PodResources instead), agents started one after the other in one run.
//!   NodePrepareResources holds its claim in the ledger in both modes, so its ledger share has
//!   no ledger-free floor: the first figure (vs GET + one fsync'd write) bounds it;
//! - API server writes: start-up until the slices are published (floor: one create per slice),
//!   a restart with an unchanged inventory (must be 0), one health change (floor: one update);
//! - fractional GPUs: NodePrepareResources of a share (consumable capacity) whose GPU's MPS
//!   daemon already runs, and of the first share of a GPU (the daemon's pod created and its
//!   daemon serving, and the pod deleted and the daemon gone by its unprepare), each vs a
//!   whole-GPU NodePrepareResources of the same agent in the same rounds; the daemons run in
//!   pods of their own as the DaemonSet has it (`--mps-daemons=pods`), the test kit's pod
//!   runner standing in for the kubelet and containerd (a process start where a real node
//!   starts a container), the stand-in `nvidia-cuda-mps-control` of hack/fake-mps in the
//!   driver root;
//! - dynamic MIG: NodePrepareResources of a claim whose MIG instance the prepare creates (and
//!   its unprepare destroys) vs a static MIG device's NodePrepareResources on the same agent in
//!   the same rounds; and the instance's create + destroy through the real NVML backend on the
//!   fake libnvidia-ml vs a bare NVML query (`nvmlDeviceGetCount`'s round trip through
//!   `discover` would include the whole inventory read, so the floor is one `responds` probe).
//!
//! The agent runs in process on simulated hardware against the API server double, the kubelet
//! device plugin double and the kubelet DRA double, all in a temp dir.
//!
//! Run: `cargo bench --bench dra` (results are kept in benches/results/).

mod common;
#[path = "dra/lab.rs"]
mod lab;
#[path = "../tests/support/mod.rs"]
mod support;

use common::{percentiles, row};
use lab::{count_row, floor_once, write_breakdown, Lab};

use gpuplane_model::source::DeviceSource;
use gpuplane_node::dra::ClaimRef;
use gpuplane_node::proto::deviceplugin_v1beta1 as pb;
use k8s_openapi::api::resource::v1::ResourceClaim;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NS: &str = "bench";
const WAIT: Duration = Duration::from_secs(20);
const WARMUP: usize = 5;
/// Prepare + unprepare rounds of one claim with one device.
const ONE_CLAIM: usize = 600;
/// Prepare + unprepare rounds of eight claims with one device each, in one request.
const EIGHT_CLAIMS: usize = 120;
/// Rounds of the share comparison: with the daemon running, and starting it.
const SHARE_ROUNDS: usize = 300;
const FIRST_SHARE_ROUNDS: usize = 40;
/// Rounds of the dynamic MIG comparison, and of the NVML create + destroy.
const DYNAMIC_ROUNDS: usize = 200;
const NVML_ROUNDS: usize = 2000;
/// Memory-limit hook runs, each a process start (and its floor, another).
const HOOK_ROUNDS: usize = 200;
/// Per agent, per round of the ledger comparison.
const LEDGER_ALLOCATES: usize = 500;
const LEDGER_ROUNDS: usize = 6;

async fn prepare_latency() {
    let lab = Lab::new("dgx-h100").await;
    let (agent, _) = lab.start_registered("", 8).await;
    lab.eventually("8 published GPUs", |l| l.published_devices() == 8)
        .await;
    let one = vec![lab.claim("one", &["gpu-0"])];
    let eight: Vec<ClaimRef> = (0..8)
        .map(|i| lab.claim(&format!("eight-{i}"), &[&format!("gpu-{i}")]))
        .collect();
    let claims: kube::Api<ResourceClaim> =
        kube::Api::namespaced(lab.api.client().expect("kube client"), NS);
    let floor_dir = lab.dir.path().join("floor");
    std::fs::create_dir_all(&floor_dir).expect("floor dir");

    // Warm up both paths; keep the CDI spec of a one-device claim as the floor's payload.
    let mut spec = Vec::new();
    for _ in 0..WARMUP {
        lab.prepare(&one).await;
        spec = std::fs::read(lab.spec_path(&one[0])).expect("CDI spec of a prepared claim");
        lab.unprepare(&one).await;
        floor_once(&claims, &one, &floor_dir, &spec).await;
    }
    println!(
        "(floor write payload: the {} B CDI spec of a one-device claim; prepare writes the checkpoint with it fsync'd, then the spec file unsynced)",
        spec.len()
    );

    for (label, refs, rounds) in [
        ("1 claim x 1 GPU", &one, ONE_CLAIM),
        ("8 claims x 1 GPU, one request", &eight, EIGHT_CLAIMS),
    ] {
        let mut prep = Vec::with_capacity(rounds);
        let mut unprep = Vec::with_capacity(rounds);
        let mut floor_prep = Vec::with_capacity(rounds);
        let mut floor_unprep = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let (gets, writes) = floor_once(&claims, refs, &floor_dir, &spec).await;
            floor_prep.push(gets + writes);
            floor_unprep.push(writes);
            let t = Instant::now();
            lab.prepare(refs).await;
            prep.push(t.elapsed());
            let t = Instant::now();
            lab.unprepare(refs).await;
            unprep.push(t.elapsed());
        }
        let n = refs.len();
        row(
            &format!("NodePrepareResources, {label} ({rounds} calls)"),
            percentiles(prep),
            percentiles(floor_prep),
        );
        row(
            &format!("NodeUnprepareResources, {label} ({rounds} calls)"),
            percentiles(unprep),
            percentiles(floor_unprep),
        );
        println!(
            "  floors: prepare = {n} GET(s) + {n} fsync'd atomic write(s); unprepare = {n} write(s)"
        );
    }
    agent.stop().await.expect("agent exits cleanly");
}

async fn ledger_overhead() {
    let lab = Lab::new("dgx-h100").await;
    let gpu0 = lab.sim.discover().expect("discover").inventory.gpus[0]
        .uuid
        .to_string();
    // GPU 0 is the device plugin's in both modes.
    let modes = [
        ("shared", "allocation: {mode: shared}\n", 8),
        (
            "partitioned",
            "allocation: {mode: partitioned, draGpus: [4, 5, 6, 7]}\n",
            4,
        ),
    ];
    let mut samples: [Vec<Duration>; 2] = Default::default();
    for _ in 0..LEDGER_ROUNDS {
        for (m, (_, config, plugin_devices)) in modes.iter().enumerate() {
            let (agent, endpoint) = lab.start_registered(config, *plugin_devices).await;
            let mut plugin = pb::device_plugin_client::DevicePluginClient::new(
                gpuplane_node::grpc::connect(&endpoint)
                    .await
                    .expect("dial plugin"),
            );
            let req = || pb::AllocateRequest {
                container_requests: vec![pb::ContainerAllocateRequest {
                    devices_ids: vec![gpu0.clone()],
                }],
            };
            for i in 0..WARMUP + LEDGER_ALLOCATES {
                let t = Instant::now();
                plugin.allocate(req()).await.expect("allocate");
                if i >= WARMUP {
                    samples[m].push(t.elapsed());
                }
            }
            agent.stop().await.expect("agent exits cleanly");
        }
    }
    let [shared, partitioned] = samples;
    println!(
        "(floor = the same call with `mode: partitioned`, where Allocate does not consult the ledger; {LEDGER_ROUNDS} alternating rounds per mode)"
    );
    row(
        &format!(
            "Allocate GPU 0, shared/ledger ({} calls)",
            LEDGER_ROUNDS * LEDGER_ALLOCATES
        ),
        percentiles(shared),
        percentiles(partitioned),
    );
}

async fn api_writes() {
    for (profile, config) in [
        ("dgx-h100", ""),
        ("h100-mig-single", "flags: {migStrategy: single}\n"),
    ] {
        let lab = Lab::new(profile).await;
        let inv = lab.sim.discover().expect("discover").inventory;
        let expected: usize = inv
            .gpus
            .iter()
            .map(|g| {
                if g.mig.current {
                    g.mig_devices.len()
                } else {
                    1
                }
            })
            .sum();

        lab.api.clear_requests();
        let (agent, _) = lab.start_registered(config, expected).await;
        lab.eventually("published slices", |l| l.published_devices() == expected)
            .await;
        let writes = lab.api.count_writes();
        let breakdown = write_breakdown(&lab.api);
        let slices = lab.slices().len();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let later = lab.api.count_writes() - writes;
        count_row(
            &format!("API writes, start-up until published, {profile}"),
            writes,
            slices,
            "one create per slice",
        );
        println!(
            "  {breakdown}; {later} more in the next 1 s; {expected} devices in {slices} slice(s)"
        );

        agent.stop().await.expect("agent exits cleanly");
        lab.api.clear_requests();
        let (agent, _) = lab.start_registered(config, expected).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        count_row(
            &format!("API writes, restart with same inventory, {profile}"),
            lab.api.count_writes(),
            0,
            "nothing changed",
        );
        if lab.api.count_writes() > 0 {
            println!("  {}", write_breakdown(&lab.api));
        }

        if profile == "dgx-h100" {
            lab.api.clear_requests();
            lab.sim.inject_xid(&inv.gpus[5].uuid, None, 48);
            lab.eventually("a taint on gpu-5", |l| l.tainted("gpu-5"))
                .await;
            let writes = lab.api.count_writes();
            let breakdown = write_breakdown(&lab.api);
            tokio::time::sleep(Duration::from_secs(1)).await;
            let later = lab.api.count_writes() - writes;
            count_row(
                &format!("API writes, one health change (Xid 48), {profile}"),
                writes,
                1,
                "one slice update",
            );
            println!("  {breakdown}; {later} more in the next 1 s");
        }
        agent.stop().await.expect("agent exits cleanly");
    }
}

/// A share prepared next to a running MPS daemon, and the first share of a GPU (daemon start
/// included), each vs a whole-GPU prepare in the same rounds.
async fn share_prepare() {
    let mut lab = Lab::new("dgx-a100").await;
    lab.node
        .api
        .put_json(serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "gpuplane-node-bench", "namespace": "gpuplane-system"},
            "spec": {"nodeName": gpuplane_testkit::doubles::lab::NODE, "containers": [{"name": "agent", "image": "gpuplane:bench"}]}}))
        .expect("the agent's own pod");
    lab.node.mps_pods = Some(gpuplane_node::mps::pods::PodSettings {
        namespace: "gpuplane-system".into(),
        name: "gpuplane-node-bench".into(),
        nvml_lib: None,
    });
    let _runner = gpuplane_testkit::doubles::pod_runner::PodRunner::start(
        lab.api.client().expect("client"),
        "gpuplane-system",
        gpuplane_testkit::doubles::lab::NODE,
        std::path::Path::new(env!("CARGO_BIN_EXE_gpuplane")),
    );
    let bin = lab.dir.path().join("driver/usr/bin");
    std::fs::create_dir_all(&bin).expect("driver bin dir");
    std::os::unix::fs::symlink(
        support::built_fake_mps(),
        bin.join("nvidia-cuda-mps-control"),
    )
    .expect("stand-in MPS control program");
    let config = "sharing:\n  consumableCapacity: {gpus: [0], memoryStep: 1Gi, computeStep: 10}\n";
    let (agent, _) = lab.start_registered(config, 8).await;
    lab.eventually("8 published GPUs", |l| l.published_devices() == 8)
        .await;
    let share = |name: &str| {
        lab.node
            .share_claim(NS, name, "gpu-0", "20Gi", 20)
            .expect("store share claim")
    };
    let anchor = vec![share("anchor")];
    let timed = vec![share("share")];
    let whole = vec![lab.claim("whole", &["gpu-1"])];
    let rounds = |n: usize, with_anchor: bool| {
        let (lab, anchor, timed, whole) = (&lab, &anchor, &timed, &whole);
        async move {
            if with_anchor {
                lab.prepare(anchor).await;
            }
            let (mut shares, mut wholes) = (Vec::new(), Vec::new());
            for i in 0..WARMUP + n {
                let t = Instant::now();
                lab.prepare(timed).await;
                let d = t.elapsed();
                lab.unprepare(timed).await;
                let t = Instant::now();
                lab.prepare(whole).await;
                let w = t.elapsed();
                lab.unprepare(whole).await;
                if i >= WARMUP {
                    shares.push(d);
                    wholes.push(w);
                }
            }
            if with_anchor {
                lab.unprepare(anchor).await;
            }
            (shares, wholes)
        }
    };
    let (running, whole_a) = rounds(SHARE_ROUNDS, true).await;
    let (first, whole_b) = rounds(FIRST_SHARE_ROUNDS, false).await;
    println!("(floor = a whole-GPU NodePrepareResources of the same agent, alternating with the share in the same rounds)");
    row(
        &format!("NodePrepare 20Gi/20% share, daemon running ({SHARE_ROUNDS} calls)"),
        percentiles(running),
        percentiles(whole_a),
    );
    row(
        &format!("NodePrepare first share, daemon pod start ({FIRST_SHARE_ROUNDS} calls)"),
        percentiles(first),
        percentiles(whole_b),
    );
    agent.stop().await.expect("agent exits cleanly");
}

async fn dynamic_mig_prepare() {
    let lab = Lab::new("dynamic-mig-mixed").await;
    // GPU 3 (an L4) is the one device the device plugin offers.
    let (agent, _) = lab
        .start_registered("dynamicMig: {gpus: [0, 1]}\n", 1)
        .await;
    lab.eventually("the dynamic devices published", |l| {
        l.slices().iter().any(|s| {
            s["spec"]["devices"]
                .as_array()
                .is_some_and(|d| d.iter().any(|d| d["name"] == "gpu-0-mig-3g40gb-at4"))
        })
    })
    .await;
    let dynamic = vec![lab.claim("dynamic", &["gpu-0-mig-3g40gb-at4"])];
    let fixed = vec![lab.claim("static", &["gpu-2-mig-3g40gb-1"])];
    let (mut made, mut floor) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + DYNAMIC_ROUNDS {
        let t = Instant::now();
        lab.prepare(&dynamic).await;
        let d = t.elapsed();
        lab.unprepare(&dynamic).await;
        let t = Instant::now();
        lab.prepare(&fixed).await;
        let f = t.elapsed();
        lab.unprepare(&fixed).await;
        if i >= WARMUP {
            made.push(d);
            floor.push(f);
        }
    }
    assert!(
        lab.sim.discover().expect("sim").inventory.gpus[0]
            .mig_devices
            .is_empty(),
        "every instance was destroyed"
    );
    println!("(floor = a static MIG device's NodePrepareResources on the same agent, alternating in the same rounds; simulated source)");
    row(
        &format!("NodePrepare 3g.40gb, instance created ({DYNAMIC_ROUNDS} calls)"),
        percentiles(made),
        percentiles(floor),
    );
    agent.stop().await.expect("agent exits cleanly");
}

/// The NVML backend on the fake libnvidia-ml: create + destroy of one instance vs one probe of
/// the same GPU (a single NVML query through the same library).
fn nvml_create_destroy() {
    std::env::set_var("GPUPLANE_FAKE_NVML_PROFILE", "dynamic-mig-mixed");
    let nvml = gpuplane_node::nvml::NvmlSource::open(Some(support::built_fake()))
        .expect("the fake libnvidia-ml opens");
    let gpu = nvml.discover().expect("discover").inventory.gpus[0]
        .uuid
        .clone();
    let req = gpuplane_model::source::MigRequest {
        gpu: gpu.clone(),
        profile: "3g.40gb".into(),
        start: 4,
    };
    let (mut cycle, mut probe) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + NVML_ROUNDS {
        let t = Instant::now();
        let m = nvml.create_mig(&req).expect("create");
        nvml.destroy_mig(&gpu, m.gpu_instance_id).expect("destroy");
        let c = t.elapsed();
        let t = Instant::now();
        std::hint::black_box(nvml.responds(gpu.as_str()));
        let p = t.elapsed();
        if i >= WARMUP {
            cycle.push(c);
            probe.push(p);
        }
    }
    println!("(floor = one NVML probe of the same GPU through the same fake library)");
    row(
        &format!("NVML create + destroy 3g.40gb, fake libnvidia-ml ({NVML_ROUNDS} calls)"),
        percentiles(cycle),
        percentiles(probe),
    );
}

/// A share's memory-limit hook as a container runtime runs it (`gpuplane cdi-hook
/// memory-limit`: process start, NVML load on the fake libnvidia-ml at driver r615, the limit
/// set on a cgroup v2 leaf holding a process) vs the same executable started for `--version`,
/// alternating. What a share's container creation costs on top of the runtime's own work.
fn memory_limit_hook() {
    let root = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .map(std::path::PathBuf::from)
        .into_iter()
        .find(|r| r.join("cgroup.controllers").is_file());
    let Some(root) = root else {
        println!("memory-limit hook: skipped (no cgroup v2 hierarchy on this host)");
        return;
    };
    let leaf = root.join(format!("gpuplane-bench-{}", std::process::id()));
    std::fs::create_dir_all(&leaf).expect("a cgroup v2 leaf (run as root)");
    let mut held = Command::new("sleep").arg("600").spawn().expect("sleep");
    std::fs::write(leaf.join("cgroup.procs"), held.id().to_string()).expect("join the leaf");
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu = gpuplane_model::sim::load("dgx-h100").expect("profile").gpus[0]
        .uuid
        .to_string();
    let exe = env!("CARGO_BIN_EXE_gpuplane");
    let state = format!(r#"{{"id":"bench","pid":{}}}"#, held.id());
    let run = |args: &[&str]| {
        let t = Instant::now();
        let mut child = Command::new(exe)
            .args(args)
            .env("GPUPLANE_FAKE_NVML_PROFILE", "dgx-h100")
            .env("GPUPLANE_FAKE_NVML_STATE", dir.path().join("state.json"))
            .env("GPUPLANE_FAKE_NVML_DRIVER_VERSION", "615.20.01")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("gpuplane");
        let _ = child
            .stdin
            .take()
            .expect("stdin")
            .write_all(state.as_bytes());
        assert!(child.wait().expect("wait").success(), "{args:?} failed");
        t.elapsed()
    };
    let lib = support::built_fake().display().to_string();
    let root_arg = root.display().to_string();
    let hook = [
        "cdi-hook",
        "memory-limit",
        "--nvml-lib",
        &lib,
        "--device",
        &gpu,
        "--limit-bytes",
        "21474836480",
        "--cgroup-root",
        &root_arg,
    ];
    let (mut hooked, mut bare) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + HOOK_ROUNDS {
        let h = run(&hook);
        let b = run(&["--version"]);
        if i >= WARMUP {
            hooked.push(h);
            bare.push(b);
        }
    }
    let _ = held.kill();
    let _ = held.wait();
    let _ = std::fs::remove_dir(&leaf);
    println!("(floor = the same executable started for --version, alternating in the same rounds)");
    row(
        &format!("memory-limit hook, fake NVML r615 ({HOOK_ROUNDS} runs)"),
        percentiles(hooked),
        percentiles(bare),
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "gpuplane DRA benchmarks ({} logical CPUs)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let started = Instant::now();
    rt.block_on(prepare_latency());
    rt.block_on(ledger_overhead());
    rt.block_on(api_writes());
    rt.block_on(share_prepare());
    rt.block_on(dynamic_mig_prepare());
    nvml_create_destroy();
    memory_limit_hook();
    println!("(whole run {:.1?})", started.elapsed());
}
