//! The GPU-hours ledger's cost in a running controller (issue 27): the controller's loops
//! against the API server double holding 10,000 running GPU pods in 100 namespaces with a
//! GpuQuota each, the CPU they take over a fixed window with the ledger on (the default 30 s
//! interval, and 2 s to show how it scales) next to the floor: the same loops with the ledger
//! off, in the same run. Also the API requests the ledger adds (book writes, GpuQuota status
//! writes) and the process's peak RSS.
//!
//! Each configuration runs in its own process (this bench starts itself again), so a peak RSS
//! and an allocator's retained memory belong to one configuration. In that process the double
//! and the controller run on two tokio runtimes with named threads, so the controller's CPU
//! (its threads' `schedstat`) is told apart from the double's; the process total is also shown.
//! The window starts once every namespace's usage is counted and (ledger on) the book exists.
//! Run: `cargo bench --bench gpu_hours_controller` (`GPUPLANE_BENCH_WINDOW_S=10` for a quick
//! look; default 60); results in benches/results/gpu_hours_controller.txt.

use gpuplane_cluster::controller::{self, ControllerOptions};
use gpuplane_cluster::controller_metrics::QueueMetrics;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

const PODS: usize = 10_000;
const NAMESPACES: usize = 100;
const TEAMS: usize = 20;
const CNS: &str = "gpuplane-system";
const BOOK: &str = "gpuplane-gpu-hours";
/// Set in the child process: `off` or the ledger's interval in seconds.
const LEDGER_ENV: &str = "GPUPLANE_BENCH_LEDGER";
const WINDOW_ENV: &str = "GPUPLANE_BENCH_WINDOW_S";
const WAIT: Duration = Duration::from_secs(300);
/// Thread name prefixes of the two runtimes (a thread's comm keeps 15 bytes).
const CTL: &str = "bench-ctl";
const DBL: &str = "bench-dbl";

/// One configuration's figures, as the child prints them on one line.
#[derive(Default, Clone, Copy)]
struct Figures {
    ctl_ms: f64,
    dbl_ms: f64,
    proc_ms: f64,
    window_s: f64,
    rss_peak_kib: u64,
    hwm_kib: u64,
    book_writes: usize,
    quota_writes: usize,
    requests: usize,
    counted_s: f64,
}

impl Figures {
    fn line(&self) -> String {
        format!(
            "RESULT {:.1} {:.1} {:.0} {:.2} {} {} {} {} {} {:.2}",
            self.ctl_ms,
            self.dbl_ms,
            self.proc_ms,
            self.window_s,
            self.rss_peak_kib,
            self.hwm_kib,
            self.book_writes,
            self.quota_writes,
            self.requests,
            self.counted_s
        )
    }

    fn parse(out: &str) -> Option<Figures> {
        let line = out.lines().find_map(|l| l.strip_prefix("RESULT "))?;
        let v: Vec<&str> = line.split_whitespace().collect();
        Some(Figures {
            ctl_ms: v.first()?.parse().ok()?,
            dbl_ms: v.get(1)?.parse().ok()?,
            proc_ms: v.get(2)?.parse().ok()?,
            window_s: v.get(3)?.parse().ok()?,
            rss_peak_kib: v.get(4)?.parse().ok()?,
            hwm_kib: v.get(5)?.parse().ok()?,
            book_writes: v.get(6)?.parse().ok()?,
            quota_writes: v.get(7)?.parse().ok()?,
            requests: v.get(8)?.parse().ok()?,
            counted_s: v.get(9)?.parse().ok()?,
        })
    }

    /// Share of one core the controller's threads took over the window, in percent.
    fn ctl_core(&self) -> f64 {
        self.ctl_ms / 10.0 / self.window_s
    }
}

fn rfc(s: i64) -> String {
    Timestamp::from_second(s).map_or_else(|_| "1970-01-01T00:00:00Z".into(), |t| t.to_string())
}

/// A running 1-GPU pod, started within the last hour, of one of 20 teams.
fn pod(i: usize, now: i64) -> Value {
    let ns = format!("team-{}", i % NAMESPACES);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p{i}"), "namespace": ns, "uid": format!("u{i}"),
                     "labels": {"team": format!("t{}", i % TEAMS), "app": "train"}},
        "spec": {"nodeName": format!("node-{}", i % 500), "containers": [{"name": "main",
                 "image": "registry.example/train:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "status": {"phase": "Running", "containerStatuses": [{"name": "main",
                   "image": "registry.example/train:1", "imageID": "", "ready": true,
                   "restartCount": 0,
                   "state": {"running": {"startedAt": rfc(now - 60 - (i % 3600) as i64)}}}]},
    })
}

fn seed(api: &ApiServerDouble) {
    let now = Timestamp::now().as_second();
    for ns in std::iter::once(CNS.to_string()).chain((0..NAMESPACES).map(|n| format!("team-{n}"))) {
        let namespace = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
        api.put_json(namespace).expect("seed a namespace");
    }
    for n in 0..NAMESPACES {
        let quota = json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": "q", "namespace": format!("team-{n}")},
            "spec": {"hard": {"devices": {"nvidia.com/gpu": PODS}}}});
        api.put_json(quota).expect("seed a GpuQuota");
    }
    for i in 0..PODS {
        api.put_json(pod(i, now)).expect("seed a pod");
    }
}

fn runtime(name: &str) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .thread_name(name)
        .enable_all()
        // Threads that exit take their CPU time out of /proc/self/task.
        .thread_keep_alive(Duration::from_secs(3600))
        .build()
        .expect("a tokio runtime")
}

/// CPU time (ms) of this process's threads whose name starts with `prefix`.
fn threads_cpu_ms(prefix: &str) -> f64 {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
    {
        let p = task.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(p.join("schedstat")).unwrap_or_default();
        ns += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
    }
    ns as f64 / 1e6
}

/// The whole process's user + system CPU time (ms), exited threads included.
fn process_cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = after
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the command; USER_HZ is 100.
    (f.get(11).unwrap_or(&0) + f.get(12).unwrap_or(&0)) as f64 * 10.0
}

/// A `/proc/self/status` figure in KiB (`VmRSS`, `VmHWM`).
fn status_kib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn counted(api: &ApiServerDouble) -> bool {
    (0..NAMESPACES).all(|n| {
        let ns = format!("team-{n}");
        api.get_json("quota.gpuplane.dev/v1alpha1", "gpuquotas", Some(&ns), "q")
            .and_then(|q| q["status"]["used"]["devices"]["nvidia.com/gpu"].as_u64())
            == Some((PODS / NAMESPACES) as u64)
    })
}

fn wait_for(what: &str, ready: impl Fn() -> bool) -> Duration {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < WAIT,
            "{what} did not happen within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

/// (book writes, GpuQuota status writes, all requests) so far.
fn requests(api: &ApiServerDouble) -> (usize, usize, usize) {
    (
        api.count_requests("PUT", &format!("/configmaps/{BOOK}")),
        api.count_requests("PUT", "/gpuquotas/q/status"),
        api.count_requests("*", ""),
    )
}

/// The child: one configuration (`interval` None: the ledger off) over `window`.
fn measure(interval: Option<Duration>, window: Duration) -> Figures {
    let dbl = runtime(DBL);
    let ctl = runtime(CTL);
    let api = dbl
        .block_on(ApiServerDouble::start())
        .expect("start the double");
    seed(&api);
    let mut loops = ControllerOptions::new(CNS, "bench");
    loops.leader_elect = false;
    match (loops.queue.hours.as_mut(), interval) {
        (Some(h), Some(every)) => {
            h.interval = every;
            h.settings.owner_labels = vec!["team".into()];
        }
        _ => loops.queue.hours = None,
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = ctl.block_on(async { api.client() }).expect("a client");
    let metrics = Arc::new(QueueMetrics::default());
    let task = ctl.spawn(controller::run(client, loops, metrics, async {
        let _ = stopped.await;
    }));
    let counted_in = wait_for("counting every pod", || counted(&api));
    if interval.is_some() {
        wait_for("the first book write", || {
            api.get_json("v1", "configmaps", Some(CNS), BOOK).is_some()
        });
    }
    std::thread::sleep(Duration::from_secs(2));
    let (c0, d0, p0, r0) = (
        threads_cpu_ms(CTL),
        threads_cpu_ms(DBL),
        process_cpu_ms(),
        requests(&api),
    );
    let start = Instant::now();
    let mut rss_peak = 0;
    while start.elapsed() < window {
        std::thread::sleep(Duration::from_millis(500));
        rss_peak = rss_peak.max(status_kib("VmRSS"));
    }
    let window_s = start.elapsed().as_secs_f64();
    let (c1, d1, p1, r1) = (
        threads_cpu_ms(CTL),
        threads_cpu_ms(DBL),
        process_cpu_ms(),
        requests(&api),
    );
    let _ = stop.send(());
    let _ = ctl.block_on(task);
    Figures {
        ctl_ms: c1 - c0,
        dbl_ms: d1 - d0,
        proc_ms: p1 - p0,
        window_s,
        rss_peak_kib: rss_peak,
        hwm_kib: status_kib("VmHWM"),
        book_writes: r1.0 - r0.0,
        quota_writes: r1.1 - r0.1,
        requests: r1.2 - r0.2,
        counted_s: counted_in.as_secs_f64(),
    }
}

/// Runs this bench again with `ledger` (`off` or seconds) and reads its figures.
fn run_child(ledger: &str) -> Figures {
    let exe = std::env::current_exe().expect("this bench's path");
    let out = Command::new(exe)
        .env(LEDGER_ENV, ledger)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("run the bench's child");
    let text = String::from_utf8_lossy(&out.stdout);
    Figures::parse(&text)
        .unwrap_or_else(|| panic!("the child ({ledger}) printed no figures: {text}"))
}

fn print_row(what: &str, f: &Figures) {
    println!(
        "{what:<26} {:>9.0} ms {:>6.2}% {:>9.0} ms {:>9.0} ms {:>8.1} {:>8.1} {:>6} {:>7} {:>8} {:>6.1}",
        f.ctl_ms,
        f.ctl_core(),
        f.dbl_ms,
        f.proc_ms,
        f.rss_peak_kib as f64 / 1024.0,
        f.hwm_kib as f64 / 1024.0,
        f.book_writes,
        f.quota_writes,
        f.requests,
        f.counted_s
    );
}

fn parent(window: Duration) {
    let off = run_child("off");
    let on: Vec<(u64, Figures)> = [30, 2]
        .iter()
        .map(|s| (*s, run_child(&s.to_string())))
        .collect();
    println!(
        "# cargo bench --bench gpu_hours_controller: {PODS} running GPU pods, {NAMESPACES} namespaces with a GpuQuota each, owner label team ({TEAMS} values), a {window:?} window per configuration, each in its own process"
    );
    println!(
        "{:<26} {:>12} {:>7} {:>12} {:>12} {:>8} {:>8} {:>6} {:>7} {:>8} {:>6}",
        "",
        "controller",
        "core",
        "double",
        "process",
        "RSS MiB",
        "HWM MiB",
        "book",
        "status",
        "requests",
        "ready"
    );
    print_row("ledger off (the floor)", &off);
    for (s, f) in &on {
        print_row(&format!("ledger on, every {s} s"), f);
    }
    for (s, f) in &on {
        summary(*s, f, &off);
    }
}

/// The ledger's overhead at one interval: the figure, the floor, the ratio and per flush.
fn summary(every_s: u64, f: &Figures, off: &Figures) {
    let overhead = f.ctl_ms - off.ctl_ms;
    let ratio = if off.ctl_ms >= 1.0 {
        format!("{:.1}x", f.ctl_ms / off.ctl_ms)
    } else {
        "n/a (floor under 1 ms)".into()
    };
    println!(
        "every {every_s:>2} s: controller CPU {:.0} ms vs floor {:.0} ms, ratio {ratio}; overhead {overhead:.0} ms = {:.3}% of one core, {:.1} ms per book write; with the double {:.0} ms = {:.3}% of one core",
        f.ctl_ms,
        off.ctl_ms,
        f.ctl_core() - off.ctl_core(),
        overhead / f.book_writes.max(1) as f64,
        f.proc_ms - off.proc_ms,
        (f.proc_ms - off.proc_ms) / 10.0 / f.window_s,
    );
    println!(
        "          +{} book writes, +{} GpuQuota status writes, +{} requests in all over {:.0} s",
        f.book_writes.saturating_sub(off.book_writes),
        f.quota_writes.saturating_sub(off.quota_writes),
        f.requests.saturating_sub(off.requests),
        f.window_s
    );
}

fn main() {
    let window = std::env::var(WINDOW_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(60), Duration::from_secs);
    match std::env::var(LEDGER_ENV) {
        Ok(ledger) => {
            let interval = ledger.parse().ok().map(Duration::from_secs);
            println!("{}", measure(interval, window).line());
        }
        Err(_) => parent(window),
    }
}
