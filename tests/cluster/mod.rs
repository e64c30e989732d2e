//! The real-cluster lab for integration tests (issue 13): upstream etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler, containerd and kubelet, started by
//! `hack/cluster/lab.sh up <workdir>` inside their own network, mount and PID namespaces, and
//! the real `gpuplane node` binary as a host process inside the lab's network namespace only.
//! hack/cluster/README.md ("phase 2") has how it works and what it costs.
//!
//! [`ClusterLab::start`] skips (returns `None`, printing why) when not root or when the cluster
//! binaries are not built (`hack/cluster/build.sh`); with the `CI` environment variable set it
//! panics instead, so CI cannot pass by skipping.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod image;
mod install;
mod kueue;
mod objects;
mod processes;
mod prometheus;

// The tests and benches name these as `cluster::...`, as before the split.
#[allow(unused_imports)]
pub use install::*;
#[allow(unused_imports)]
pub use kueue::*;
#[allow(unused_imports)]
pub use objects::*;
#[allow(unused_imports)]
pub use processes::*;
#[allow(unused_imports)]
pub use prometheus::*;

/// The one polling helper (tests/support/eventually.rs), included by path because the benches
/// include this module without tests/support (the lab tier, which has both, loads it twice).
#[allow(clippy::duplicate_mod)]
#[path = "../support/eventually.rs"]
mod polling;
pub use polling::blocking::{eventually, eventually_or};

/// A hang guard for each wait, never a timing assertion: a loaded machine is slow, not wrong.
pub const WAIT: Duration = polling::blocking::LIMIT;
/// The lab's node, as its kubelet registers it.
pub const NODE: &str = "lab-node";
/// The DRA driver name the agent serves (the DeviceClasses' driver).
pub const DRIVER: &str = "gpu.gpuplane.dev";
/// The agent's namespace and service account (daemonset/node/rbac.yaml).
pub const AGENT_NS: &str = "gpuplane-system";
pub const AGENT_SA: &str = "gpuplane-node";
/// The agent's user name on the API server (its service account).
pub const AGENT_USER: &str = "system:serviceaccount:gpuplane-system:gpuplane-node";
/// The controller's service account (daemonset/controller/rbac.yaml), same namespace.
pub const CONTROLLER_SA: &str = "gpuplane-controller";
/// Where the controller serves the webhook in the lab's network namespace.
pub const WEBHOOK_ADDR: &str = "127.0.0.1:9443";
/// Where the controller serves /metrics, /healthz and /readyz there.
pub const CONTROLLER_METRICS_ADDR: &str = "127.0.0.1:9480";

pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Skips the test (prints why and returns `None`), or panics under `CI`.
fn skip(why: &str) -> Option<ClusterLab> {
    if std::env::var_os("CI").is_some() {
        panic!("real-cluster test cannot run, and CI is set so it may not skip: {why}");
    }
    eprintln!("SKIPPED: real-cluster test: {why}");
    None
}

/// The directory of the cluster binaries: `GPUPLANE_CLUSTER_BIN`, else what
/// `hack/cluster/build.sh --check` reports (it builds nothing).
fn cluster_bin() -> Result<PathBuf, String> {
    cluster_bin_with(&["kubelet"])
}

/// [`cluster_bin`], which must hold each of `needed` (e.g. helm and kubectl).
pub fn cluster_bin_with(needed: &[&str]) -> Result<PathBuf, String> {
    let missing = |d: &Path| -> Vec<String> {
        needed
            .iter()
            .filter(|b| !d.join(b).exists())
            .map(|b| b.to_string())
            .collect()
    };
    if let Some(dir) = std::env::var_os("GPUPLANE_CLUSTER_BIN") {
        let dir = PathBuf::from(dir);
        let lacks = missing(&dir);
        return if lacks.is_empty() {
            Ok(dir)
        } else {
            Err(format!(
                "GPUPLANE_CLUSTER_BIN={} has no {} (run ./hack/cluster/build.sh)",
                dir.display(),
                lacks.join(", ")
            ))
        };
    }
    let out = Command::new(repo().join("hack/cluster/build.sh"))
        .arg("--check")
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("running hack/cluster/build.sh --check: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout
        .lines()
        .find_map(|l| l.strip_prefix("GPUPLANE_CLUSTER_BIN="))
    {
        Some(dir) if out.status.success() && missing(Path::new(dir)).is_empty() => {
            Ok(PathBuf::from(dir))
        }
        _ => Err(format!(
            "the cluster binaries are not built (run ./hack/cluster/build.sh, about 26 min \
             cold): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Lines of a gpuplane log that report an API refusal (the API server's message reads `... is
/// forbidden: User ...`, kube's error adds the reason `Forbidden` and `code: 403`). Not a bare
/// `403`: timestamps' fractions and UUIDs contain it by chance.
pub fn refusals(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            l.contains("Forbidden") || l.contains("is forbidden") || l.contains("code: 403")
        })
        .collect()
}

/// One lab: the `lab.sh` process, its work dir and the namespaces' init. Dropping it kills
/// every process of the namespaces, removes their cgroups and the work dir (kept, with a
/// printed path, when `GPUPLANE_LAB_KEEP` is set).
pub struct ClusterLab {
    script: Child,
    /// The lab's work dir (`/tmp/gpl-XXXXXX`: unix socket paths are limited to 107 bytes).
    pub work: PathBuf,
    /// Host pid of the namespaces' init.
    pub init: u32,
    /// The cluster binaries.
    pub bin: PathBuf,
    /// How long the start took (lab.sh up to node Ready).
    pub start_time: Duration,
    /// Held until the lab is gone (a field drops after `Drop::drop` has torn the lab down).
    _slot: LabSlot,
}

/// The machine's lab slots: `GPUPLANE_LABS` labs at once (default 1: on two cores a second lab
/// doubles every wait rather than halving the tier; benches/results/labs_at_once.txt has the
/// measurement). Tests of one binary run on several threads, so a lab waits for a slot to be
/// torn down. A token rather than a `MutexGuard`, which could not move to another thread with
/// its lab.
struct LabSlot;

static LABS_RUNNING: std::sync::Mutex<usize> = std::sync::Mutex::new(0);
static LAB_FREED: std::sync::Condvar = std::sync::Condvar::new();

/// How many labs may run at once.
fn lab_slots() -> usize {
    std::env::var("GPUPLANE_LABS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(1)
}

impl LabSlot {
    fn take() -> LabSlot {
        let slots = lab_slots();
        let mut running = LABS_RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        while *running >= slots {
            running = LAB_FREED.wait(running).unwrap_or_else(|e| e.into_inner());
        }
        *running += 1;
        LabSlot
    }
}

impl Drop for LabSlot {
    fn drop(&mut self) {
        let mut running = LABS_RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        *running = running.saturating_sub(1);
        LAB_FREED.notify_one();
    }
}

impl ClusterLab {
    /// Starts a one-node lab and waits for node `lab-node` to be Ready; `None` when it must skip.
    pub fn start() -> Option<ClusterLab> {
        ClusterLab::start_nodes(1)
    }

    /// Starts a lab of `nodes` nodes (lab-node, lab-node-2, ...) and waits until all are
    /// Ready; `None` when it must skip.
    pub fn start_nodes(nodes: usize) -> Option<ClusterLab> {
        if !is_root() {
            return skip("needs root (namespaces, mounts, cgroups)");
        }
        let bin = match cluster_bin() {
            Ok(b) => b,
            Err(e) => return skip(&e),
        };
        for tool in ["unshare", "nsenter", "openssl", "curl", "runc", "python3"] {
            if Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(Stdio::null())
                .status()
                .map_or(true, |s| !s.success())
            {
                return skip(&format!("{tool} is not installed"));
            }
        }
        let slot = LabSlot::take();
        let work = tempfile::Builder::new()
            .prefix("gpl-")
            .tempdir_in("/tmp")
            .unwrap()
            .keep();
        let out = std::fs::File::create(work.with_extension("log")).unwrap();
        let began = Instant::now();
        let script = Command::new(repo().join("hack/cluster/lab.sh"))
            .arg("up")
            .arg(&work)
            .env("GPUPLANE_CLUSTER_BIN", &bin)
            .env("LAB_NODES", nodes.to_string())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start hack/cluster/lab.sh");
        let mut lab = ClusterLab {
            script,
            work,
            init: 0,
            bin,
            start_time: Duration::ZERO,
            _slot: slot,
        };
        lab.init = eventually("lab.sh to write init.pid", || {
            std::fs::read_to_string(lab.work.join("init.pid"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
        });
        eventually("the lab to be ready (node lab-node Ready)", || {
            if lab.work.join("failed").exists() || lab.script.try_wait().unwrap().is_some() {
                panic!("the lab failed to start:\n{}", lab.diagnostics());
            }
            lab.work.join("ready").exists().then_some(())
        });
        lab.start_time = began.elapsed();
        eprintln!(
            "cluster lab {} up in {:.1}s",
            lab.work.display(),
            lab.start_time.as_secs_f64()
        );
        Some(lab)
    }

    /// The lab's nodes, lab-node first (lab.sh's nodes.txt).
    pub fn nodes(&self) -> Vec<LabNode> {
        std::fs::read_to_string(self.work.join("nodes.txt"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                match f.as_slice() {
                    [name, ip, dir, sock] => Some(LabNode {
                        name: name.to_string(),
                        ip: ip.to_string(),
                        dir: PathBuf::from(dir),
                        containerd: PathBuf::from(sock),
                    }),
                    _ => None,
                }
            })
            .collect()
    }

    /// `ctr images import` of an image tar into every node's containerd (namespace k8s.io,
    /// the CRI's).
    pub fn import_image(&self, tar: &Path) {
        for node in self.nodes() {
            let out = Command::new(self.bin.join("ctr"))
                .arg("--address")
                .arg(&node.containerd)
                .args(["-n", "k8s.io", "images", "import"])
                .arg(tar)
                .output()
                .expect("run ctr");
            assert!(
                out.status.success(),
                "importing {} into {}: {}",
                tar.display(),
                node.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// A command that runs `program` inside the lab's network namespace (only).
    pub fn in_netns(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg("--net")
            .arg("--target")
            .arg(self.init.to_string())
            .arg("--")
            .arg(program);
        cmd
    }

    /// A command that runs `program` as on node lab-node itself: in the lab's network
    /// namespace and the node's mount namespace (`/var/run/cdi`, `/var/lib/kubelet` are the
    /// node's), as a node-local tool sees the node.
    pub fn on_node(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        self.on_node_at(&self.work, program)
    }

    /// [`ClusterLab::on_node`] on `node`.
    pub fn on(&self, node: &LabNode, program: impl AsRef<std::ffi::OsStr>) -> Command {
        self.on_node_at(&node.dir, program)
    }

    /// The node whose directory (with its `mnt.pid`) is `dir`.
    fn on_node_at(&self, dir: &Path, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let holder = std::fs::read_to_string(dir.join("mnt.pid")).unwrap();
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/proc/{}/ns/net", self.init))
            // The pid is the lab's (its own PID namespace): seen through the lab's /proc.
            .arg(format!(
                "--mount=/proc/{}/root/proc/{}/ns/mnt",
                self.init,
                holder.trim()
            ))
            .arg("--")
            .arg(program);
        cmd
    }

    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.work.join("pki/admin.kubeconfig")
    }

    /// The real kubectl, as cluster admin, in the lab's network namespace.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_as(&self.admin_kubeconfig(), args, None)
    }

    /// The real kubectl with `kubeconfig`'s identity, `stdin` fed to it when given.
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Output {
        use std::io::Write;
        let mut child = self
            .in_netns(self.bin.join("kubectl"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kubectl");
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes()).unwrap();
        }
        child.wait_with_output().expect("run kubectl")
    }

    /// `kubectl describe pod <name>` (namespace default), the events and the node, for
    /// failure messages.
    pub fn describe_pod(&self, name: &str) -> String {
        self.describe_pod_in("default", name)
    }

    /// [`ClusterLab::describe_pod`] for a pod of namespace `ns`.
    pub fn describe_pod_in(&self, ns: &str, name: &str) -> String {
        let d = self.kubectl(&["describe", "pod", name, "-n", ns]);
        let e = self.kubectl(&["get", "events", "-A"]);
        let n = self.kubectl(&["describe", "node", NODE]);
        format!(
            "{}{}\n{}\n{}",
            String::from_utf8_lossy(&d.stdout),
            String::from_utf8_lossy(&d.stderr),
            String::from_utf8_lossy(&e.stdout),
            String::from_utf8_lossy(&n.stdout)
        )
    }

    /// kubectl that must succeed; its stdout.
    /// `kubectl create -f - -o json` (as admin), as a user types it: the created object, or
    /// kubectl's error text.
    pub fn create(&self, yaml: &str, extra: &[&str]) -> Result<Value, String> {
        let mut args = vec!["create", "-f", "-", "-o", "json"];
        args.extend(extra);
        let out = self.kubectl_as(&self.admin_kubeconfig(), &args, Some(yaml));
        if out.status.success() {
            Ok(serde_json::from_slice(&out.stdout).unwrap())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// kubectl ... -o json, parsed; `None` when kubectl fails (e.g. not found yet).
    pub fn get_json(&self, args: &[&str]) -> Option<Value> {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        let out = self.kubectl(&a);
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).unwrap())
    }

    /// `kubectl apply -f -` with `yaml` on stdin.
    pub fn apply(&self, yaml: &str) {
        let out = self.kubectl_as(&self.admin_kubeconfig(), &["apply", "-f", "-"], Some(yaml));
        assert!(
            out.status.success(),
            "kubectl apply failed: {}\n{yaml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The writes by `user` (a service account's user name) the API server has audited so far
    /// (hack/cluster/lab.sh audits gpuplane's service accounts), each as
    /// `verb resource[/subresource] namespace/name -> code`.
    pub fn audited_writes(&self, user: &str) -> Vec<String> {
        let text = std::fs::read_to_string(self.work.join("audit.log")).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["user"]["username"] == user)
            .map(|e| {
                let o = &e["objectRef"];
                let s = |v: &Value| v.as_str().unwrap_or("").to_string();
                let sub = o["subresource"]
                    .as_str()
                    .map(|x| format!("/{x}"))
                    .unwrap_or_default();
                format!(
                    "{} {}{sub} {}/{} -> {}",
                    s(&e["verb"]),
                    s(&o["resource"]),
                    s(&o["namespace"]),
                    s(&o["name"]),
                    e["responseStatus"]["code"]
                )
            })
            .collect()
    }

    /// The kubelet's `--root-dir`, complete as the host sees it (device-plugins/ is
    /// bind-mounted inside the lab on the hard-coded /var/lib/kubelet/device-plugins).
    pub fn kubelet_root(&self) -> PathBuf {
        self.work.join("kubelet")
    }

    /// Where containerd reads CDI specs from.
    pub fn cdi_dir(&self) -> PathBuf {
        self.work.join("cdi")
    }

    /// Adds `lines` (YAML, each ending in a newline) to lab-node's KubeletConfiguration
    /// (`topologyManagerPolicy: single-numa-node`, say) and restarts its kubelet with them.
    pub fn configure_kubelet(&self, lines: &str) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(self.work.join("kubelet.yaml"))
            .unwrap();
        f.write_all(lines.as_bytes()).unwrap();
        self.restart_kubelet();
    }

    /// Restarts the kubelet (SIGTERM, then a fresh one) and waits for its `/healthz`.
    pub fn restart_kubelet(&self) {
        let ctl = self.work.join("ctl");
        let n = std::fs::read_dir(&ctl)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("kubelet-restarted-")
            })
            .count();
        std::fs::write(ctl.join("restart-kubelet"), "").unwrap();
        let done = ctl.join(format!("kubelet-restarted-{}", n + 1));
        eventually("the kubelet to restart", || done.exists().then_some(()));
    }

    /// Every component's log tail and lab.sh's own output.
    pub fn diagnostics(&self) -> String {
        let mut s = String::new();
        let mut files = vec![self.work.with_extension("log")];
        if let Ok(dir) = std::fs::read_dir(self.work.join("log")) {
            let mut logs: Vec<PathBuf> = dir.map(|e| e.unwrap().path()).collect();
            logs.sort();
            files.extend(logs);
        }
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(30);
            s += &format!("---- tail {}\n{}\n", f.display(), lines[from..].join("\n"));
        }
        s
    }

    /// Lines of `log/<component>.log` containing `needle` (for reading the kubelet's side).
    pub fn log_lines(&self, component: &str, needle: &str) -> Vec<String> {
        std::fs::read_to_string(self.work.join(format!("log/{component}.log")))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .map(String::from)
            .collect()
    }

    /// `kubectl apply -k` of daemonset/ through the lab's overlay (see [`lab_overlay`]):
    /// everything gpuplane ships, the quota webhooks only when `webhooks` (a lab without the
    /// controller must not send GPU pods to a webhook nobody serves). Waits for the GpuQuota
    /// CRD to be Established; returns kubeconfigs with real tokens of both service accounts.
    pub fn install(&self, webhooks: bool) -> Installed {
        let tls = self.work.join("webhook-tls");
        std::fs::create_dir_all(&tls).unwrap();
        let pki = gpuplane_testkit::demo::tls::DemoPki::issue(&tls).unwrap();
        let overlay = self.work.join("overlay");
        std::fs::create_dir_all(&overlay).unwrap();
        std::fs::write(
            overlay.join("kustomization.yaml"),
            lab_overlay(&overlay, webhooks.then_some(pki.ca_pem.as_str())),
        )
        .unwrap();
        // As users run it: it must succeed, and without a `Warning:` from the API server (an
        // unknown schema format, a deprecated field), which users would read on every apply.
        let out = self.kubectl(&["apply", "-k", overlay.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "kubectl apply -k daemonset/ failed: {}{stderr}",
            String::from_utf8_lossy(&out.stdout)
        );
        let warnings: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("Warning:"))
            .collect();
        assert!(
            warnings.is_empty(),
            "kubectl apply -k daemonset/ printed warnings:\n{}",
            warnings.join("\n")
        );
        eventually("the GpuQuota CRD to be Established", || {
            let crd = self.get_json(&["get", "crd", "gpuquotas.quota.gpuplane.dev"])?;
            crd["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "Established" && c["status"] == "True")
                .then_some(())
        });
        // The agent's token is bound to node lab-node (as a token bound to the agent's pod
        // would be), so the admission policy sees the node.
        let agent = self.token_kubeconfig(
            "agent",
            &[
                "create",
                "token",
                AGENT_SA,
                "-n",
                AGENT_NS,
                "--bound-object-kind",
                "Node",
                "--bound-object-name",
                NODE,
                "--duration",
                "2h",
            ],
        );
        let controller = self.token_kubeconfig(
            "controller",
            &[
                "create",
                "token",
                CONTROLLER_SA,
                "-n",
                AGENT_NS,
                "--duration",
                "2h",
            ],
        );
        Installed {
            agent,
            controller,
            webhook_cert: pki.cert_file,
            webhook_key: pki.key_file,
        }
    }

    /// The node agent's part of [`ClusterLab::install`] (no webhooks); the agent's kubeconfig.
    pub fn install_agent_identity(&self) -> PathBuf {
        self.install(false).agent
    }

    /// A kubeconfig for the API server with the token `kubectl <create_token>` prints.
    pub fn token_kubeconfig(&self, who: &str, create_token: &[&str]) -> PathBuf {
        let token = self.kubectl_ok(create_token);
        let path = self.work.join(format!("{who}.kubeconfig"));
        let ca = self.work.join("pki/ca.crt");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster: {{server: \"https://127.0.0.1:6443\", certificate-authority: \"{}\"}}\nusers:\n- name: {who}\n  user: {{token: \"{}\"}}\ncontexts:\n- name: lab\n  context: {{cluster: lab, user: {who}, namespace: {AGENT_NS}}}\ncurrent-context: lab\n",
                ca.display(),
                token.trim()
            ),
        )
        .unwrap();
        path
    }
}

/// One node of the lab: its name, node IP, the directory that is its `/var/lib/kubelet`
/// (`kubelet/`), `/var/run/cdi` (`cdi/`) and `/var/lib/gpuplane` (`gpuplane/`), and its
/// containerd's socket.
pub struct LabNode {
    pub name: String,
    pub ip: String,
    pub dir: PathBuf,
    pub containerd: PathBuf,
}

impl LabNode {
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.join("kubelet")
    }
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.join("cdi")
    }
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("gpuplane")
    }
}

impl Drop for ClusterLab {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.diagnostics());
        }
        // SIGKILL to the init takes every process of the PID namespace along (SIGTERM is
        // ignored by it); lab.sh then returns, removing the lab's cgroups.
        if self.init != 0 {
            let _ = Command::new("kill")
                .args(["-KILL", &self.init.to_string()])
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.script.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.script.kill();
                let _ = self.script.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Depth-first removal of whatever cgroups lab.sh could not remove.
        let name = format!(
            "gpuplane-lab-{}",
            self.work.file_name().unwrap().to_string_lossy()
        );
        if let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in hierarchies.flatten() {
                let root = h.path().join(&name);
                if root.is_dir() {
                    remove_cgroup(&root);
                }
            }
        }
        if std::env::var_os("GPUPLANE_LAB_KEEP").is_some() {
            eprintln!("cluster lab kept in {}", self.work.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.work);
            let _ = std::fs::remove_file(self.work.with_extension("log"));
        }
    }
}

fn remove_cgroup(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}
