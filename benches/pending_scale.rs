//! "Why is my GPU pod Pending?" at scale (issue 26): 1,000 nodes x 8 GPUs faked by kwok
//! against the real kube-apiserver, kube-scheduler and kube-controller-manager of the cluster
//! lab (control plane only, `LAB_NODES=0`), and 5,000 Pending GPU pods of five reasons, with
//! the real `gpuplane controller` explaining them. Each figure next to a floor from the same
//! run:
//!
//! - time from a change (a node added or removed, a pod deleted or created) to the updated
//!   reason on the 1,000 pods it flips, as the bench's watch sees the condition; floor: the
//!   same watch seeing the change itself, and the bench's own 1,000 condition PATCHes on the
//!   same pods, 32 in flight as the explainer's (what the API server takes, under this load);
//! - time from a new Pending pod to its reason; floor: the watch seeing the pod;
//! - `gpuplane explain pod` (the CLI, a process per call); floor: `kubectl get pod`;
//! - the webhook: a GPU pod's admission (dry run) against a pod the webhooks skip; the queue
//!   loop: a GpuQuota raise to the next queued pod's release, against the raise's round trip;
//! - the controller's CPU and peak memory, next to the kube-scheduler's (which caches the
//!   same nodes and pods); the API requests it makes (the API server's priority-and-fairness
//!   count for its flow schema, `service-accounts`: no other client of the lab falls in it).
//!
//! The cluster: nodes `node-NNNN` with `nvidia.com/gpu: 8` in their status (patched, as the
//! device plugin's registration makes the kubelet report it) and one ResourceSlice each, which
//! the model's renderer makes from a simulated dgx-h100 (a100 for the last tenth), as the agent
//! would. Filler pods bound to every node leave 6 GPUs free: 1 on each of two nodes, 4 on one
//! tainted node. Pending: `cap-*` asks 8 (Capacity), `place-*` 4 (Placement: only the tainted
//! node has that many), `frag-*` 2 (Fragmentation), `sel-*` a claim for a product that does not
//! exist (Selector), `q-*` 2 in a Queue-mode namespace over its GpuQuota (Quota).
//!
//! Needs root, the cluster binaries and kwok (`./hack/cluster/build.sh kwok`); prints why and
//! exits 0 otherwise. `PENDING_SCALE_NODES` and `PENDING_SCALE_PODS` (per reason) scale it
//! down. Run: `cargo bench --bench pending_scale`; results in benches/results/pending_scale.txt.

#[path = "../tests/cluster/mod.rs"]
mod cluster;
mod common;
#[path = "pending_scale/loops.rs"]
mod loops;
#[path = "pending_scale/procs.rs"]
mod procs;
#[path = "pending_scale/setup.rs"]
mod setup;
#[path = "pending_scale/watch.rs"]
mod watch;

use cluster::{start_controller, wait_controller_ready, ClusterLab};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const REASONS: [&str; 5] = [
    "Capacity",
    "Placement",
    "Fragmentation",
    "Selector",
    "Quota",
];
/// How long a wait for the controller may take before the bench gives up.
const PATIENCE: Duration = Duration::from_secs(600);

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// kwok's binary, from `hack/cluster/build.sh --check kwok` (it builds nothing).
fn kwok() -> Result<PathBuf, String> {
    let out = Command::new(cluster::repo().join("hack/cluster/build.sh"))
        .args(["--check", "kwok"])
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("running hack/cluster/build.sh --check kwok: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("GPUPLANE_CLUSTER_BIN="))
        .map(|d| PathBuf::from(d).join("kwok"))
        .filter(|k| out.status.success() && k.exists())
        .ok_or_else(|| "kwok is not built (run ./hack/cluster/build.sh kwok, ~4 min)".into())
}

/// kwok in the lab's network namespace, faking every node; killed on drop.
struct Kwok(Child);

impl Kwok {
    fn start(lab: &ClusterLab, bin: &PathBuf) -> Kwok {
        let log = std::fs::File::create(lab.work.join("kwok.log")).unwrap();
        let child = lab
            .in_netns(bin)
            .arg("--kubeconfig")
            .arg(lab.admin_kubeconfig())
            .arg("-c")
            .arg(cluster::repo().join("hack/cluster/kwok/stages.yaml"))
            .args(["--manage-all-nodes", "--node-lease-duration-seconds=40"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start kwok");
        Kwok(child)
    }
}

impl Drop for Kwok {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    let kwok_bin = match kwok() {
        Ok(k) => k,
        Err(e) => return eprintln!("SKIPPED: pending_scale: {e}"),
    };
    let Some(lab) = ClusterLab::start_nodes(0) else {
        return;
    };
    let size = setup::Size {
        nodes: env_or("PENDING_SCALE_NODES", 1000),
        pods: env_or("PENDING_SCALE_PODS", 1000),
    };
    // install() binds the agent's token to node lab-node, which the lab has not here: a node
    // kwok fakes too, without GPUs.
    lab.apply("apiVersion: v1\nkind: Node\nmetadata: {name: lab-node, labels: {type: kwok}}\n");
    let installed = lab.install(true);
    let _kwok = Kwok::start(&lab, &kwok_bin);
    // The client runs in the lab's network namespace, where the API server listens; threads
    // inherit the namespace of the thread that creates them, so enter it before the runtime.
    let netns = std::fs::File::open(format!("/proc/{}/ns/net", lab.init)).unwrap();
    nix::sched::setns(netns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let kubeconfig = kube::config::Kubeconfig::read_from(lab.admin_kubeconfig()).unwrap();
        let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        config.read_timeout = Some(Duration::from_secs(300));
        let client = kube::Client::try_from(config).unwrap();
        println!(
            "# cargo bench --bench pending_scale — {}; {} kwok nodes x 8 GPUs, {} Pending GPU \
             pods ({} per reason); Kubernetes v1.37.2 control plane + kwok v0.8.0 + gpuplane \
             controller, all on this machine's {} cores",
            common_now(),
            size.nodes,
            size.pods * 5,
            size.pods,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        let book = watch::Shared::default();
        watch::start(&client, &book);
        // The controller serves the quota webhooks, which pod creation goes through.
        let controller = start_controller(&lab, &installed, "bench");
        wait_controller_ready(&lab);
        let pid = controller_pid(&lab);
        let requests = || setup::controller_requests(&client);
        let (cpu0, req0, began) = (procs::cpu_seconds(pid), requests().await, Instant::now());
        setup::cluster(&lab, &client, &size).await;
        println!("cluster built in {:.0?}", began.elapsed());
        let all = size.pods * 5;
        watch::until(&book, "every Pending pod's first reason", PATIENCE, |b| {
            REASONS.iter().map(|r| watch::count(b, "", r)).sum::<usize>() >= all
        })
        .await;
        let (cpu1, req1) = (procs::cpu_seconds(pid), requests().await);
        println!(
            "build + first classification of {all} pods: {:.1?} (controller CPU {:.1}s, {:.0} API requests)",
            began.elapsed(),
            cpu1 - cpu0,
            req1 - req0
        );
        run(&lab, &client, &book, &size, pid).await;
        drop(controller);
    });
}

/// The controller's pid: nsenter execs it, so it is the one `gpuplane` in the lab's netns.
fn controller_pid(lab: &ClusterLab) -> u32 {
    cluster::eventually("the controller's process", || {
        procs::in_lab(lab.init, "gpuplane")
    })
}

fn common_now() -> String {
    let out = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The measured part, once the cluster is built and every pod explained.
async fn run(
    lab: &ClusterLab,
    client: &kube::Client,
    book: &watch::Shared,
    size: &setup::Size,
    pid: u32,
) {
    let requests = || setup::controller_requests(client);
    let sched = procs::in_lab(lab.init, "kube-scheduler").unwrap_or(0);
    let (sched_cpu0, cpu2) = (procs::cpu_seconds(sched), procs::cpu_seconds(pid));
    let (req2, t2) = (requests().await, Instant::now());
    let flips = setup::flips(client, book, size).await;
    setup::new_pods(client, book).await;
    let span = t2.elapsed().as_secs_f64();
    let (cpu3, req3) = (procs::cpu_seconds(pid), requests().await);
    println!(
        "during the changes ({span:.0}s): controller CPU {:.1}s ({:.0}% of a core) | floor: kube-scheduler {:.1}s",
        cpu3 - cpu2,
        100.0 * (cpu3 - cpu2) / span,
        procs::cpu_seconds(sched) - sched_cpu0
    );
    println!(
        "API requests by the controller: {:.1}/s during the changes ({:.0} in {span:.0}s)",
        (req3 - req2) / span,
        req3 - req2
    );
    setup::explain_latency(lab, &size.explain_sample()).await;
    loops::webhook(client).await;
    loops::queue(client, book).await;
    // Last: its writes make the explainer plan again.
    setup::write_floor(client, book, size, &flips).await;
    let (peak, sched_peak) = (procs::mem_mib(pid, "VmHWM"), procs::mem_mib(sched, "VmHWM"));
    println!(
        "controller peak RSS {peak:.0} MiB (target <= 256 MiB: {}) | floor: kube-scheduler peak RSS {sched_peak:.0} MiB | ratio {:.2}x",
        if peak <= 256.0 { "met" } else { "NOT met" },
        peak / sched_peak
    );
    println!("controller CPU in all: {:.1}s", procs::cpu_seconds(pid));
}
