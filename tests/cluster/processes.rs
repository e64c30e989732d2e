//! gpuplane as host processes inside the lab's network namespace: the node agent and the
//! controller, their logs, and the `gpuplane` CLI against the lab.

use super::*;

/// A real `gpuplane` process in the lab's network namespace (a host process otherwise: host
/// mounts and PIDs), logging to `<work>/<name>.log`. Killed when dropped.
pub struct LabProcess {
    child: Child,
    pub log: PathBuf,
}

/// The node agent: `gpuplane node` with the flags of daemonset/node/daemonset.yaml where they
/// apply and a simulated (or fake-NVML) device source.
pub struct LabAgent;

impl LabAgent {
    /// Starts the agent on the simulated dgx-h100 with the DaemonSet's config and both APIs;
    /// `tag` names its log (`<work>/agent-<tag>.log`).
    pub fn start(lab: &ClusterLab, kubeconfig: &Path, tag: &str) -> LabProcess {
        LabAgent::start_with(
            lab,
            kubeconfig,
            tag,
            &["--simulate", "dgx-h100", "--device-plugin=true"],
            &[],
            None,
        )
    }

    /// The agent's directory (`dev/`, `driver/`, `state/`, `config.yaml`).
    pub fn dir(lab: &ClusterLab) -> PathBuf {
        lab.work.join("agent")
    }

    /// Starts the agent with `args`: its device source (`--simulate P` or `--nvml-lib L`) and
    /// `--device-plugin=BOOL` (DRA is always on), extra environment, and `config` instead of
    /// the DaemonSet's ConfigMap when given.
    pub fn start_with(
        lab: &ClusterLab,
        kubeconfig: &Path,
        tag: &str,
        args: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
        config: Option<&str>,
    ) -> LabProcess {
        let dir = LabAgent::dir(lab);
        std::fs::create_dir_all(dir.join("dev")).unwrap();
        std::fs::create_dir_all(dir.join("driver")).unwrap();
        // The DaemonSet's config file: the ConfigMap's config.yaml.
        let cm: serde_yaml_ng::Value = serde_yaml_ng::from_str(
            &std::fs::read_to_string(repo().join("daemonset/node/config.yaml")).unwrap(),
        )
        .unwrap();
        let text = config.unwrap_or_else(|| cm["data"]["config.yaml"].as_str().unwrap());
        std::fs::write(dir.join("config.yaml"), text).unwrap();
        let mut cmd = lab.in_netns(env!("CARGO_BIN_EXE_gpuplane"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.arg("node")
            .args(args)
            .args(["--node-name", NODE])
            .arg("--kubelet-root")
            .arg(lab.kubelet_root())
            .arg("--cdi-root")
            .arg(lab.cdi_dir())
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--driver-root")
            .arg(dir.join("driver"))
            .arg("--dev-root")
            .arg(dir.join("dev"))
            .arg("--config")
            .arg(dir.join("config.yaml"))
            .arg("--dra=true")
            .arg(format!("--driver-name={DRIVER}"))
            .arg("--metrics-addr=127.0.0.1:9400")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .env("NODE_NAME", NODE)
            .env_remove("GPUPLANE_CRASHPOINT");
        LabProcess::spawn(lab, cmd, &format!("agent-{tag}"))
    }
}

/// `gpuplane ARGS --kubeconfig <admin>` in the lab's network namespace, its JSON output.
pub fn gpuplane_json(lab: &ClusterLab, args: &[&str]) -> Value {
    let out = lab
        .in_netns(env!("CARGO_BIN_EXE_gpuplane"))
        .args(args)
        .arg("--kubeconfig")
        .arg(lab.admin_kubeconfig())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpuplane {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Waits until the controller's `/readyz` answers 200 (its caches synced, the webhook served).
pub fn wait_controller_ready(lab: &ClusterLab) {
    eventually("the controller to be ready", || {
        let out = lab
            .in_netns("curl")
            .args(["-sf", &format!("http://{CONTROLLER_METRICS_ADDR}/readyz")])
            .output()
            .unwrap();
        out.status.success().then_some(())
    });
}

/// The quota controller: `gpuplane controller` with the Deployment's flags, serving the
/// webhook on [`WEBHOOK_ADDR`] with the certificate [`ClusterLab::install`] issued.
pub fn start_controller(lab: &ClusterLab, installed: &Installed, tag: &str) -> LabProcess {
    start_controller_with(lab, installed, tag, &[])
}

/// [`start_controller`] with `extra` flags.
pub fn start_controller_with(
    lab: &ClusterLab,
    installed: &Installed,
    tag: &str,
    extra: &[&str],
) -> LabProcess {
    let mut cmd = lab.in_netns(env!("CARGO_BIN_EXE_gpuplane"));
    cmd.arg("controller")
        .arg("--kubeconfig")
        .arg(&installed.controller)
        .arg(format!("--webhook-addr={WEBHOOK_ADDR}"))
        .arg("--tls-cert-file")
        .arg(&installed.webhook_cert)
        .arg("--tls-key-file")
        .arg(&installed.webhook_key)
        .arg(format!("--metrics-addr={CONTROLLER_METRICS_ADDR}"))
        .arg("--leader-elect=true")
        .args(extra)
        .env("POD_NAMESPACE", AGENT_NS)
        .env("POD_NAME", format!("controller-{tag}"))
        // As the Deployment sets it (daemonset/controller/deployment.yaml).
        .env("MALLOC_ARENA_MAX", "2");
    LabProcess::spawn(lab, cmd, &format!("controller-{tag}"))
}

impl LabProcess {
    pub(super) fn spawn(lab: &ClusterLab, mut cmd: Command, name: &str) -> LabProcess {
        let log = lab.work.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let child = cmd
            .env("RUST_LOG", "info")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name} in the lab's network namespace: {e}"));
        LabProcess { child, log }
    }

    /// Stops it as the kubelet stops a pod: SIGTERM, then SIGKILL after 30 s.
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL, as an OOM kill or a node's crash does, and wait until it is gone.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LabProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = self.log_text();
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(40);
            eprintln!(
                "---- tail {}\n{}",
                self.log.display(),
                lines[from..].join("\n")
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
