//! Helpers shared by the integration tests (and the soak bench); each uses a part of them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

pub mod eventually;
#[allow(unused_imports)] // not every test crate polls
pub use eventually::{eventually, eventually_async};

/// Builds the fake (once per test binary) and returns the path cargo reports for it. It is
/// built with the profile this test was (hack/test.sh uses `ci`), so it shares its artifacts.
pub fn built_fake() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        built_artifact("fake-nvml", "nvidia_ml", |m| {
            m["filenames"]
                .as_array()?
                .iter()
                .filter_map(|f| f.as_str().map(PathBuf::from))
                .find(|f| f.extension().is_some_and(|e| e == "so"))
        })
    })
}

/// Builds the fake `nvidia-cuda-mps-control` (hack/fake-mps) like [`built_fake`] builds the
/// fake NVML, and returns the path cargo reports for the executable.
pub fn built_fake_mps() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        built_artifact("fake-mps", "nvidia-cuda-mps-control", |m| {
            m["executable"].as_str().map(PathBuf::from)
        })
    })
}

/// The fake CUDA client of hack/fake-mps (`fake-cuda-client`): a share container's program
/// connecting to its MPS daemon and reporting the limits it got.
pub fn built_fake_cuda_client() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        built_artifact("fake-mps", "fake-cuda-client", |m| {
            m["executable"].as_str().map(PathBuf::from)
        })
    })
}

/// What hack/test.sh built every stand-in with (`cargo build` arguments): asking cargo for the
/// same build again finds it fresh, where `-p <package>` alone would resolve the workspace's
/// features differently and compile dozens of crates a second time in the middle of the tests.
const SUITE_BUILD: &str = "GPUPLANE_SUITE_BUILD";

/// `cargo build` of `package` with this test's profile (the whole suite's build when
/// [`SUITE_BUILD`] names it); the file `pick` finds in the compiler-artifact message of the
/// non-test target `target`.
fn built_artifact(
    package: &str,
    target: &str,
    pick: impl Fn(&serde_json::Value) -> Option<PathBuf>,
) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let what: Vec<String> = match std::env::var(SUITE_BUILD) {
        Ok(args) if !args.trim().is_empty() => args.split_whitespace().map(String::from).collect(),
        _ => vec!["-p".into(), package.into()],
    };
    let mut build = Command::new(cargo);
    // What cargo sets for this test process describes the test, not the build: a build script
    // that reruns when one changes (ring's, on CARGO_MANIFEST_DIR) would otherwise compile its
    // crate and everything above it again.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name == "CARGO_MANIFEST_DIR"
            || name == "CARGO_MANIFEST_PATH"
            || name == "CARGO_CRATE_NAME"
            || name == "CARGO_PRIMARY_PACKAGE"
            || name == "CARGO_TARGET_TMPDIR"
            || name == "OUT_DIR"
            || name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_")
        {
            build.env_remove(&*name);
        }
    }
    let out = build
        .arg("build")
        .args(&what)
        .args(["--profile", own_profile()])
        .arg("--message-format=json-render-diagnostics")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run cargo build {what:?}: {e}"));
    assert!(out.status.success(), "cargo build {what:?} failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| {
            m["reason"] == "compiler-artifact"
                && m["target"]["name"] == target
                && m["profile"]["test"] == false
        })
        .find_map(|m| pick(&m))
        .unwrap_or_else(|| panic!("cargo build {what:?} reported no {target} artifact"))
}

/// The cargo profile this test binary was built with, read from where cargo put the agent
/// binary: `target/<dir>/gpuplane`, where the dir of `dev` is `debug`.
fn own_profile() -> &'static str {
    let dir = Path::new(env!("CARGO_BIN_EXE_gpuplane"))
        .parent()
        .and_then(Path::file_name)
        .and_then(|d| d.to_str())
        .unwrap_or("debug");
    match dir {
        "debug" => "dev",
        other => other,
    }
}

/// The agent binary as a child process with its own node directory: kubelet root, CDI root,
/// state dir, device nodes and a kubeconfig for the API server double. Killed (SIGKILL) when
/// dropped, so a failing test leaves no agent behind.
pub struct AgentProcess {
    child: std::process::Child,
    /// Where `/metrics`, `/healthz` and `/readyz` answer.
    pub metrics: std::net::SocketAddr,
    /// Its stdout and stderr.
    pub log: PathBuf,
}

/// The node name the agent serves.
pub const NODE: &str = "node-a";
/// The DRA driver name the agent serves.
pub const DRIVER: &str = "gpu.gpuplane.dev";

/// Lays out `root` for the agent: `dev/` with `nvidia0..gpus` and the control nodes, and
/// `kubeconfig` pointing at `api_url` (plain HTTP, no auth, as the double serves).
///
/// The nodes are character devices with the driver's numbers where this process may mknod
/// (root): the agent on NVML checks them. Elsewhere they are empty files, which such an agent
/// refuses to put into CDI specs (a `--simulate` agent does not look at them).
pub fn lay_out_node(root: &Path, gpus: usize, api_url: &str) {
    let dev = root.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    let minors = (0..gpus).map(|i| u32::try_from(i).unwrap());
    if gpuplane_testkit::doubles::devnodes::can_make_nodes() {
        gpuplane_testkit::doubles::devnodes::make_gpu_nodes(&dev, minors).unwrap();
    } else {
        let mut names: Vec<String> = minors.map(|i| format!("nvidia{i}")).collect();
        names.extend(["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"].map(String::from));
        for n in names {
            std::fs::write(dev.join(n), "").unwrap();
        }
    }
    write_kubeconfig(root, api_url);
}

/// `<root>/kubeconfig` pointing at `api_url` (plain HTTP, no auth, as the double serves).
pub fn write_kubeconfig(root: &Path, api_url: &str) -> PathBuf {
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster: {{server: \"{api_url}\"}}\nusers:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context: {{cluster: double, user: test}}\ncurrent-context: test\n"
    );
    let path = root.join("kubeconfig");
    std::fs::write(&path, kubeconfig).unwrap();
    path
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    // Not from the kernel's ephemeral range (32768-60999 by default), which port 0 and every
    // outgoing connection draw from: a port found free there can be taken by another test's
    // connection before the agent binds it ("Address already in use" in CI). Below the range,
    // only listeners we place compete, and a per-process sequence keeps ours apart.
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = std::process::id().wrapping_mul(7919);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + (base.wrapping_add(n.wrapping_mul(13)) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// `<bin> node --node-name node-a` with the node's paths under `root` (see [`lay_out_node`]):
/// `kubelet/`, `cdi/`, `state/`, `driver/`, `dev/`, `config.yaml` and `kubeconfig`.
pub fn node_command(bin: &Path, root: &Path) -> Command {
    let p = |d: &str| root.join(d).into_os_string();
    let mut cmd = Command::new(bin);
    cmd.arg("node")
        .args(["--node-name", NODE])
        .arg("--kubelet-root")
        .arg(p("kubelet"))
        .arg("--cdi-root")
        .arg(p("cdi"))
        .arg("--state-dir")
        .arg(p("state"))
        .arg("--driver-root")
        .arg(p("driver"))
        .arg("--dev-root")
        .arg(p("dev"))
        .arg("--config")
        .arg(p("config.yaml"))
        .arg("--kubeconfig")
        .arg(p("kubeconfig"));
    cmd
}

impl AgentProcess {
    /// Runs `gpuplane node` on `root` (see [`lay_out_node`]) with `config` as its config file,
    /// `source` (`--simulate P` or `--nvml-lib L`) and extra environment; `tag` names the log.
    pub fn spawn(
        root: &Path,
        config: &str,
        source: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
        tag: &str,
    ) -> AgentProcess {
        let metrics: std::net::SocketAddr = ([127, 0, 0, 1], free_port()).into();
        std::fs::write(root.join("config.yaml"), config).unwrap();
        let log = root.join(format!("agent-{tag}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = node_command(Path::new(env!("CARGO_BIN_EXE_gpuplane")), root);
        // A caller may serve another driver name (`--driver-name` among `source`).
        if !source.contains(&"--driver-name") {
            cmd.args(["--driver-name", DRIVER]);
        }
        cmd.arg("--dra=true")
            .arg("--metrics-addr")
            .arg(metrics.to_string())
            .args(source)
            .env_remove("GPUPLANE_CRASHPOINT")
            .env_remove("KUBECONFIG")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start the gpuplane binary");
        AgentProcess {
            child,
            metrics,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running (it has not exited or crashed).
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits up to `limit` for the process to exit on its own; its exit status, or `None` if
    /// it is still running.
    pub fn wait_exit(&mut self, limit: std::time::Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// SIGKILL, and wait until it is gone.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// The log so far, for failure messages.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `GET path` on the metrics address: (status code, body); `None` while nothing answers.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.metrics, path)
    }

    /// The value of one sample in `/metrics`, e.g. `gpuplane_ledger_held_units{api="dra"}`.
    pub fn metric(&self, sample: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        metric_value(&body, sample)
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.0 GET: (status code, body); `None` when the connection or read fails.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: agent\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((code, body))
}

/// The checks `gpuplane doctor` runs on a simulated node with a running agent.
pub const DOCTOR_NODE_CHECKS: &[&str] = &[
    "nvml",
    "kubelet",
    "kubelet-apis",
    "cdi",
    "containerd",
    "agent",
];

/// What `gpuplane doctor -o json` printed: whether it passed, and its checks.
pub fn doctor_report(out: &std::process::Output) -> (bool, Vec<serde_json::Value>) {
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let checks = report["checks"]
        .as_array()
        .unwrap_or_else(|| panic!("no checks in {report}"))
        .clone();
    (out.status.success(), checks)
}

/// The doctor checks of `checks` that failed, by name.
pub fn doctor_failed(checks: &[serde_json::Value]) -> Vec<String> {
    checks
        .iter()
        .filter(|c| c["status"] == "fail")
        .filter_map(|c| c["check"].as_str().map(String::from))
        .collect()
}

/// The doctor check `name` of `checks`.
pub fn doctor_check<'a>(checks: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    checks
        .iter()
        .find(|c| c["check"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {checks:#?}"))
}

/// The value of `sample` (name with labels, exactly as rendered) in a Prometheus text body.
pub fn metric_value(body: &str, sample: &str) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(sample)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// Stores a ResourceClaim in `team-a` allocated by the (absent) scheduler to `devices` of
/// this node's pool, and returns it as the kubelet names it.
pub fn put_claim(
    api: &gpuplane_testkit::doubles::apiserver::ApiServerDouble,
    name: &str,
    devices: &[&str],
) -> gpuplane_node::dra::ClaimRef {
    let results: Vec<serde_json::Value> = devices
        .iter()
        .map(
            |d| serde_json::json!({"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d}),
        )
        .collect();
    let stored = api
        .put_json(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.gpuplane.dev", "count": devices.len()}}]}},
            "status": {"allocation": {"devices": {"results": results}}}
        }))
        .unwrap();
    gpuplane_node::dra::ClaimRef::parse("team-a", stored["metadata"]["uid"].as_str().unwrap(), name)
        .unwrap()
}

/// Resident memory of process `pid` (`VmRSS` in `/proc/<pid>/status`), in KiB.
pub fn vm_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}
