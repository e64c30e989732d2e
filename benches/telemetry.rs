//! Device telemetry at 8 GPUs x 7 MIG devices (h100-mig-single: 8 GPUs and 56 MIG devices, 64
//! devices sampled). Each figure is printed next to a floor measured in the same run on the same
//! machine, and the ratio:
//! - NVML sampling CPU: an agent sampling every second for `TELEMETRY_BENCH_ROUNDS` (default 60)
//!   rounds, its process CPU (`utime + stime` in `/proc/<pid>/stat`) minus that of the same agent
//!   with telemetry off over the same wall time, per round, as a share of one core at the
//!   default 10 s interval; next to the telemetry-off agent's own idle share. Also the sampling
//!   threads' own CPU (`/proc/<pid>/task/<tid>/schedstat`, nanoseconds), and the 10 s agent's,
//!   measured directly over the same window;
//! - `/metrics` scrape latency: `TELEMETRY_BENCH_SCRAPES` (default 500) sequential GETs (a new
//!   connection each, as Prometheus over HTTP/1.0), alternating between the agent sampling every
//!   10 s and the one with telemetry off; p50 and p99, and the response sizes;
//! - agent resident memory (`VmRSS`): after the first rounds and after all of them (the 1 s
//!   agent), and after the scrapes (the 10 s agent), next to the telemetry-off agent's;
//! - the series count: sample lines of the `gpuplane_device_*` and `gpuplane_container_*`
//!   families in one scrape, and all sample lines, next to the telemetry-off agent's.
//!
//! The three agents run side by side, each `gpuplane node --nvml-lib <fake libnvidia-ml>` (the
//! real NVML code path; the fake answers from a telemetry file) with the device plugin on
//! (`migStrategy: single`, 56 devices), DRA off, and an API server double of its own for the
//! pods: the node as the DaemonSet runs it (`--host-proc`), except that the devices are the fake
//! library's. Each MIG device is held by a pod (Allocate, then listed by PodResources) whose one
//! container runs three processes on it; the host /proc the agents read (`--host-proc`) gives
//! each process its pod's cgroup, so every process is attributed to its container. The GPUs
//! (in MIG mode) report temperature, power and throttling; their processes are their MIG
//! devices'. The binary is the one `GPUPLANE_SHIPPED_BIN` names (benches/common/shipped.rs).
//!
//! The sampling CPU is the agent's side of NVML (the calls, the per-process cgroup reads, the
//! bookkeeping) with the fake library's answers, which are cheap and in-process: a real
//! driver's calls are ioctls whose time in the kernel driver is counted to the agent too, and
//! is not measured here.
//!
//! Run: `cargo bench --bench telemetry` (results are kept in benches/results/telemetry.txt).

#[path = "telemetry/agent.rs"]
mod agent;
mod common;
#[path = "common/shipped.rs"]
mod shipped;
#[path = "../tests/support/mod.rs"]
mod support;

use agent::Agent;
use common::{percentiles, row};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const PROFILE: &str = "h100-mig-single";
/// The node the agents run as: `support::node_command`'s, so their pods are this node's.
use support::NODE;
const RESOURCE: &str = "nvidia.com/gpu";
const CONFIG: &str = "flags: {migStrategy: single}\n";
/// Processes per MIG device, all in the container of the pod holding it.
const PROCESSES: u32 = 3;
/// GETs of /metrics per agent, unless `TELEMETRY_BENCH_SCRAPES` says.
const SCRAPES: usize = 500;
/// A hang guard for waits, never a timing.
const WAIT: Duration = Duration::from_secs(60);
/// The sampling interval the CPU share is reported at (the default).
const REPORTED_INTERVAL: Duration = Duration::from_secs(10);
/// The interval the CPU is measured at, to get many rounds in little time.
const FAST_INTERVAL: Duration = Duration::from_secs(1);
/// The targets.
const CPU_TARGET_PERCENT: f64 = 1.0;
const RSS_GROWTH_TARGET_KIB: i64 = 2 * 1024;
const MIB: u64 = 1 << 20;

/// A pod holding one MIG device through the device plugin API, its one container running
/// `pids` on it.
struct Holder {
    namespace: String,
    name: String,
    uid: String,
    container_id: String,
    device: String,
    pids: Vec<u32>,
}

/// The workload every agent is given: one [`Holder`] per MIG device, the GPUs' UUIDs.
fn workload() -> (Vec<Holder>, Vec<String>) {
    let inventory = gpuplane_model::sim::load(PROFILE).expect("bundled profile");
    let gpus = inventory.gpus.iter().map(|g| g.uuid.to_string()).collect();
    let migs = inventory
        .gpus
        .iter()
        .flat_map(|g| g.mig_devices.iter().map(|m| m.uuid.to_string()));
    let holders = migs
        .enumerate()
        .map(|(i, device)| {
            let n = u32::try_from(i).expect("few devices");
            Holder {
                namespace: format!("team-{}", n % 4),
                name: format!("train-{n}"),
                uid: format!("7d3e1c2a-0000-4000-8000-{n:012x}"),
                container_id: format!("{:064x}", u64::from(n) + 0xc0ffee),
                device,
                pids: (0..PROCESSES).map(|p| 10_000 + n * 10 + p).collect(),
            }
        })
        .collect();
    (holders, gpus)
}

/// The files all agents read: the host /proc (each process's cgroup) and the fake NVML's
/// telemetry file.
fn lay_out_shared(root: &Path, holders: &[Holder], gpus: &[String]) -> (PathBuf, PathBuf) {
    let host_proc = root.join("hostproc");
    let mut devices = serde_json::Map::new();
    for (i, gpu) in gpus.iter().enumerate() {
        let i = u32::try_from(i).expect("few GPUs");
        devices.insert(
            gpu.clone(),
            json!({
                "temperatureC": 40 + i,
                "powerMilliwatts": 350_000 + 1_000 * i,
                "powerLimitMilliwatts": 700_000,
                "throttleReasons": 0,
            }),
        );
    }
    for h in holders {
        for pid in &h.pids {
            let dir = host_proc.join(pid.to_string());
            std::fs::create_dir_all(&dir).expect("host /proc dir");
            let cgroup = format!("0::/kubepods/besteffort/pod{}/{}\n", h.uid, h.container_id);
            std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup file");
        }
        let processes: Vec<_> = h
            .pids
            .iter()
            .zip(1u64..)
            .map(|(pid, k)| json!({"pid": pid, "memoryBytes": k * 512 * MIB}))
            .collect();
        devices.insert(h.device.clone(), json!({ "processes": processes }));
    }
    let telemetry = root.join("telemetry.json");
    std::fs::write(&telemetry, json!({ "devices": devices }).to_string()).expect("telemetry file");
    (host_proc, telemetry)
}

/// The sample lines of a Prometheus text body.
fn samples(body: &str) -> impl Iterator<Item = &str> {
    body.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
}

/// The telemetry families' sample lines, and per family.
fn telemetry_series(body: &str) -> (usize, Vec<(String, usize)>) {
    let mut per: Vec<(String, usize)> = Vec::new();
    for l in samples(body) {
        if !(l.starts_with("gpuplane_device_") || l.starts_with("gpuplane_container_")) {
            continue;
        }
        let family = l.split(['{', ' ']).next().unwrap_or(l);
        match per.iter_mut().find(|(f, _)| f == family) {
            Some((_, n)) => *n += 1,
            None => per.push((family.to_string(), 1)),
        }
    }
    (per.iter().map(|(_, n)| n).sum(), per)
}

/// The process's CPU time so far, `utime + stime` of `/proc/<pid>/stat`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat");
    // Fields after the command name (which may hold spaces): state is the 3rd field, utime the
    // 14th, stime the 15th.
    let rest = stat.rsplit_once(')').expect("stat format").1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f[i].parse::<u64>().expect("stat field");
    field(11) + field(12)
}

/// The CPU time of the process's sampling threads (`gpuplane-sample`), from each thread's
/// `schedstat` (nanoseconds on a CPU), and how many there are.
fn sampler_ns(pid: u32) -> (u64, usize) {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc/<pid>/task");
    let mut total = (0, 0);
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != "gpuplane-sample" {
            continue;
        }
        let ns = std::fs::read_to_string(task.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        total = (total.0 + ns, total.1 + 1);
    }
    total
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 where it cannot say).
fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0)
}

fn rss(agent: &Agent) -> i64 {
    support::vm_rss_kib(agent.pid()).map_or(0, |k| i64::try_from(k).expect("RSS in KiB"))
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

/// Runs the benchmark's phases in order: the header, the three agents started and ready, the
/// CPU and memory window, the scrapes, and the series of one scrape.
async fn bench(rounds: u32, scrapes: usize) {
    let (bin, which) = shipped::binary();
    let (holders, gpus) = workload();
    print_header((&bin, which), &holders, &gpus);
    let shared_dir = tempfile::tempdir().expect("temp dir");
    let (host_proc, telemetry) = lay_out_shared(shared_dir.path(), &holders, &gpus);
    let shared = (host_proc.as_path(), telemetry.as_path());

    let [off, every_10s, every_1s] = start_agents(shared, &holders).await;

    let window = Window::measure([&off, &every_10s, &every_1s], rounds).await;
    window.print_cpu();
    window.print_rss(rounds);
    every_1s.stop().await;

    scrape_and_print(&off, &every_10s, scrapes, &window.rss_first).await;
    print_series(&off, &every_10s);

    off.stop().await;
    every_10s.stop().await;
}

/// Prints what is measured: the profile, the devices sampled, the processes, the CPUs, and the
/// binary (`binary`: its path and which it is) and fake NVML used.
fn print_header(binary: (&str, &str), holders: &[Holder], gpus: &[String]) {
    let (bin, which) = binary;
    let processes = holders.iter().map(|h| h.pids.len()).sum::<usize>();
    let devices = gpus.len() + holders.len();
    println!(
        "gpuplane device telemetry: {PROFILE}, {} GPUs + {} MIG devices = {devices} devices sampled, {processes} GPU processes in {} containers ({} logical CPUs)",
        gpus.len(),
        holders.len(),
        holders.len(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "({which} binary, {bin}; fake NVML {})",
        support::built_fake().display()
    );
}

/// Starts the three agents (telemetry off, every 10 s, every 1 s, in that order), gives each
/// the pods' MIG devices and waits until it is ready, then lets the 1 s agent sample a few
/// rounds before the first readings.
async fn start_agents(shared: (&Path, &Path), holders: &[Holder]) -> [Agent; 3] {
    let off = Agent::start("telemetry off", "0", shared, holders).await;
    let every_10s = Agent::start("every 10 s", "10s", shared, holders).await;
    let every_1s = Agent::start("every 1 s", "1s", shared, holders).await;
    for (agent, telemetry) in [(&off, false), (&every_10s, true), (&every_1s, true)] {
        agent.hold(holders).await;
        agent.wait_ready(holders.len(), telemetry).await;
    }
    // A few rounds of the 1 s agent before the first readings.
    tokio::time::sleep(Duration::from_secs(5)).await;
    [off, every_10s, every_1s]
}

/// The CPU and memory readings of one window of `rounds` seconds, nothing scraped meanwhile;
/// each array is indexed as the agents are: telemetry off, every 10 s, every 1 s.
struct Window {
    /// The window's wall time, seconds.
    wall: f64,
    /// Clock ticks per second.
    hz: f64,
    /// Each agent's process CPU over the window, seconds.
    cpu_s: Vec<f64>,
    /// Each agent's sampling threads' CPU over the window, seconds.
    thread_s: Vec<f64>,
    /// How many sampling threads the 1 s agent has.
    threads: usize,
    /// `VmRSS` at the window's start and end, KiB.
    rss_first: [i64; 3],
    rss_rounds: [i64; 3],
}

impl Window {
    /// Reads the agents' memory and CPU, sleeps `rounds` fast intervals, and reads them again.
    async fn measure(agents: [&Agent; 3], rounds: u32) -> Window {
        let rss_first = agents.map(rss);
        let cpu_before = agents.map(|a| cpu_ticks(a.pid()));
        let threads_before = agents.map(|a| sampler_ns(a.pid()));
        let start = Instant::now();
        tokio::time::sleep(FAST_INTERVAL * rounds).await;
        let cpu_after = agents.map(|a| cpu_ticks(a.pid()));
        let threads_after = agents.map(|a| sampler_ns(a.pid()));
        let wall = start.elapsed().as_secs_f64();
        let rss_rounds = agents.map(rss);
        let hz = clock_ticks();
        let cpu_s: Vec<f64> = (0..3)
            .map(|i| (cpu_after[i] - cpu_before[i]) as f64 / hz)
            .collect();
        let thread_s: Vec<f64> = (0..3)
            .map(|i| (threads_after[i].0 - threads_before[i].0) as f64 / 1e9)
            .collect();
        Window {
            wall,
            hz,
            cpu_s,
            thread_s,
            threads: threads_after[2].1,
            rss_first,
            rss_rounds,
        }
    }

    /// `cpu` seconds as a share of one core over the window, percent.
    fn share(&self, cpu: f64) -> f64 {
        cpu / self.wall * 100.0
    }

    /// Prints the sampling CPU: the process CPU of each agent, per round, and as a share of a
    /// core at the reported 10 s interval, next to the telemetry-off agent's idle share.
    fn print_cpu(&self) {
        let (wall, hz, cpu_s, thread_s) = (self.wall, self.hz, &self.cpu_s, &self.thread_s);
        let at_10s = |per_round: f64| per_round / REPORTED_INTERVAL.as_secs_f64() * 100.0;
        let rounds_1s = wall / FAST_INTERVAL.as_secs_f64();
        let rounds_10s = wall / REPORTED_INTERVAL.as_secs_f64();
        let floor = self.share(cpu_s[0]);
        let per_round = (cpu_s[2] - cpu_s[0]) / rounds_1s;
        let per_round_threads = thread_s[2] / rounds_1s;
        println!();
        println!(
            "NVML sampling CPU, {wall:.1} s window (~{rounds_1s:.0} rounds at 1 s, ~{rounds_10s:.0} at 10 s), CPU time from /proc/<pid>/stat ({hz} ticks/s):"
        );
        println!(
            "  process CPU: every 1 s {:.3} s, every 10 s {:.3} s | floor (telemetry off) {:.3} s",
            cpu_s[2], cpu_s[1], cpu_s[0]
        );
        println!(
            "  per round (every 1 s minus floor, / rounds) {:.2} ms; the {} sampling threads alone (schedstat) {:.2} ms",
            per_round * 1e3,
            self.threads,
            per_round_threads * 1e3
        );
        let sampling = at_10s(per_round);
        println!(
            "{:<56} {sampling:>7.3}% of a core | floor (telemetry off, idle) {floor:>7.3}% | ratio {:>5.2}x | target <= {CPU_TARGET_PERCENT}%: {}",
            "Sampling CPU at a 10 s interval (from the 1 s agent)",
            sampling / floor,
            met(sampling <= CPU_TARGET_PERCENT)
        );
        let threads = at_10s(per_round_threads);
        println!(
            "{:<56} {threads:>7.3}% of a core | floor (telemetry off, idle) {floor:>7.3}% | ratio {:>5.2}x",
            "  the sampling threads alone (schedstat)",
            threads / floor
        );
        // Six rounds at 10 s are a few clock ticks of process CPU: the threads' own time is the
        // figure here, the process's is printed with its resolution.
        let direct_threads = self.share(thread_s[1]);
        println!(
            "{:<56} {direct_threads:>7.3}% of a core | floor (telemetry off, idle) {floor:>7.3}% | ratio {:>5.2}x",
            "  the 10 s agent's sampling threads, measured directly",
            direct_threads / floor
        );
        println!(
            "  (the 10 s agent's process CPU minus the floor: {:+.3}% of a core, +-{:.3}% for a clock tick)",
            self.share(cpu_s[1] - cpu_s[0]),
            self.share(1.0 / hz)
        );
    }

    /// Prints the agents' `VmRSS` over the window: its growth for the 1 s and 10 s agents next
    /// to the telemetry-off agent's, and what telemetry adds at the window's end.
    fn print_rss(&self, rounds: u32) {
        let (rss_first, rss_rounds) = (&self.rss_first, &self.rss_rounds);
        let growth = |i: usize| rss_rounds[i] - rss_first[i];
        println!();
        println!(
            "{:<56} {:>7} KiB -> {:>7} KiB, growth {:>+6} KiB | floor (telemetry off) {:>7} -> {:>7} KiB, growth {:>+6} KiB | ratio {:>4.2}x | target growth <= {RSS_GROWTH_TARGET_KIB} KiB: {}",
            format!("VmRSS, every 1 s, after {rounds} more rounds"),
            rss_first[2],
            rss_rounds[2],
            growth(2),
            rss_first[0],
            rss_rounds[0],
            growth(0),
            rss_rounds[2] as f64 / rss_rounds[0] as f64,
            met(growth(2) <= RSS_GROWTH_TARGET_KIB)
        );
        println!(
            "{:<56} {:>7} KiB -> {:>7} KiB, growth {:>+6} KiB | floor (telemetry off) {:>7} -> {:>7} KiB, growth {:>+6} KiB | ratio {:>4.2}x",
            "VmRSS, every 10 s, same window",
            rss_first[1],
            rss_rounds[1],
            growth(1),
            rss_first[0],
            rss_rounds[0],
            growth(0),
            rss_rounds[1] as f64 / rss_rounds[0] as f64,
        );
        println!(
            "{:<56} every 1 s {:>+6} KiB, every 10 s {:>+6} KiB (VmRSS minus the floor's, window's end) | target <= {RSS_GROWTH_TARGET_KIB} KiB: {}",
            "VmRSS telemetry adds",
            rss_rounds[2] - rss_rounds[0],
            rss_rounds[1] - rss_rounds[0],
            met((rss_rounds[2] - rss_rounds[0]).max(rss_rounds[1] - rss_rounds[0]) <= RSS_GROWTH_TARGET_KIB)
        );
    }
}

/// Times `scrapes` GETs of /metrics alternating between the 10 s agent and the telemetry-off
/// one, and prints their latency, their response sizes, and the agents' `VmRSS` after them
/// next to `rss_first` (the window's start).
async fn scrape_and_print(off: &Agent, every_10s: &Agent, scrapes: usize, rss_first: &[i64; 3]) {
    let (a, b) = (off.metrics, every_10s.metrics);
    let (t_off, t_on, size_off, size_on) = tokio::task::spawn_blocking(move || {
        let (mut t_off, mut t_on) = (Vec::new(), Vec::new());
        let (mut size_off, mut size_on) = (0, 0);
        for _ in 0..scrapes {
            for (addr, times, size) in
                [(a, &mut t_off, &mut size_off), (b, &mut t_on, &mut size_on)]
            {
                let t = Instant::now();
                let (code, body) = support::http_get(addr, "/metrics").expect("GET /metrics");
                times.push(t.elapsed());
                assert_eq!(code, 200, "GET /metrics");
                *size = body.len();
            }
        }
        (t_off, t_on, size_off, size_on)
    })
    .await
    .expect("scrapes");
    println!();
    row(
        &format!("GET /metrics, every 10 s ({scrapes} scrapes)"),
        percentiles(t_on),
        percentiles(t_off),
    );
    println!(
        "{:<56} {size_on:>7} bytes | floor (telemetry off) {size_off:>7} bytes | ratio {:>5.2}x",
        "  response size",
        size_on as f64 / size_off as f64
    );
    let rss_scraped = [rss(off), rss(every_10s)];
    println!(
        "{:<56} {:>7} KiB -> {:>7} KiB, growth {:>+6} KiB | floor (telemetry off) {:>7} -> {:>7} KiB, growth {:>+6} KiB | ratio {:>4.2}x",
        format!("VmRSS, every 10 s, after the window and {scrapes} scrapes"),
        rss_first[1],
        rss_scraped[1],
        rss_scraped[1] - rss_first[1],
        rss_first[0],
        rss_scraped[0],
        rss_scraped[0] - rss_first[0],
        rss_scraped[1] as f64 / rss_scraped[0] as f64,
    );
    let added = rss_scraped[1] - rss_scraped[0];
    println!(
        "{:<56} every 10 s {added:>+6} KiB (VmRSS minus the floor's, after the scrapes) | target <= {RSS_GROWTH_TARGET_KIB} KiB: {}",
        "VmRSS telemetry adds",
        met(added <= RSS_GROWTH_TARGET_KIB)
    );
}

/// Prints the series of one scrape of the 10 s agent next to the telemetry-off agent's: the
/// telemetry families' sample lines, all sample lines, and the count per telemetry family.
fn print_series(off: &Agent, every_10s: &Agent) {
    let body_on = every_10s.scrape().expect("scrape");
    let body_off = off.scrape().expect("scrape");
    let (telemetry_on, families) = telemetry_series(&body_on);
    let (telemetry_off, _) = telemetry_series(&body_off);
    let (all_on, all_off) = (samples(&body_on).count(), samples(&body_off).count());
    println!();
    println!(
        "{:<56} {telemetry_on:>7} | floor (telemetry off) {telemetry_off:>7}",
        "Series, gpuplane_device_* and gpuplane_container_*"
    );
    println!(
        "{:<56} {all_on:>7} | floor (telemetry off) {all_off:>7} | ratio {:>5.2}x",
        "Series, all sample lines",
        all_on as f64 / all_off as f64
    );
    for (family, n) in families {
        println!("  {family:<54} {n:>7}");
    }
}

/// A number from the environment variable `name`, if set and one.
fn from_env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.parse().ok()
}

fn main() {
    let rounds: u32 = from_env("TELEMETRY_BENCH_ROUNDS").unwrap_or(60);
    let scrapes: usize = from_env("TELEMETRY_BENCH_SCRAPES").unwrap_or(SCRAPES);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(bench(rounds, scrapes));
}
