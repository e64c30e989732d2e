//! One agent under measurement: `gpuplane node` on the fake NVML with its API server and
//! kubelet doubles, in a directory of its own; its start, the pods' MIG devices given to it as
//! the kubelet does, its /metrics, and the wait until it is ready.

use super::{samples, shipped, support, Holder, CONFIG, NODE, PROFILE, RESOURCE, WAIT};
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use serde_json::json;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// One agent and its doubles, in a directory of its own.
pub struct Agent {
    what: &'static str,
    dir: tempfile::TempDir,
    /// Serves the pods and the node while the agent runs.
    _api: ApiServerDouble,
    kubelet: KubeletDouble,
    child: Child,
    pub metrics: SocketAddr,
}

impl Agent {
    /// Starts the API server and kubelet doubles, stores the node and the pods, and runs the
    /// agent sampling every `interval` (`0`: telemetry off).
    pub async fn start(
        what: &'static str,
        interval: &str,
        shared: (&Path, &Path),
        holders: &[Holder],
    ) -> Agent {
        let (host_proc, telemetry) = shared;
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let api = ApiServerDouble::start().await.expect("API server double");
        api.put_json(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
            .expect("store the node");
        for h in holders {
            api.put_json(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": h.name, "namespace": h.namespace, "uid": h.uid},
                "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "cuda"}]},
                "status": {"phase": "Running", "containerStatuses": [{
                    "name": "main", "containerID": format!("containerd://{}", h.container_id),
                    "image": "cuda", "imageID": "", "ready": true, "restartCount": 0}]}
            }))
            .expect("store a pod");
        }
        let kubelet = KubeletDouble::start(&root.join("kubelet"))
            .await
            .expect("kubelet double");
        support::lay_out_node(root, 8, &api.url());
        std::fs::write(root.join("config.yaml"), CONFIG).expect("config");
        let metrics: SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
        let log = std::fs::File::create(root.join("agent.log")).expect("log file");
        let (bin, _) = shipped::binary();
        let child = support::node_command(Path::new(&bin), root)
            .arg("--dra=false")
            .arg("--metrics-addr")
            .arg(metrics.to_string())
            .arg("--nvml-lib")
            .arg(support::built_fake())
            .arg(format!("--telemetry-interval={interval}"))
            .arg("--host-proc")
            .arg(host_proc)
            .env("GPUPLANE_FAKE_NVML_PROFILE", PROFILE)
            .env("GPUPLANE_FAKE_NVML_TELEMETRY", telemetry)
            .env("RUST_LOG", "warn")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .expect("start the gpuplane binary");
        Agent {
            what,
            dir,
            _api: api,
            kubelet,
            child,
            metrics,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// Waits for the device plugin's 56 devices, then gives each pod its MIG device as the
    /// kubelet does (Allocate, then listed by PodResources).
    pub async fn hold(&self, holders: &[Holder]) {
        let seen = self
            .kubelet
            .wait_for(WAIT, |p| {
                p.get(RESOURCE)
                    .is_some_and(|v| v.devices.len() == holders.len())
            })
            .await
            .unwrap_or_else(|e| panic!("{}: registration: {e}\n{}", self.what, self.log()));
        let offered = &seen[RESOURCE].devices;
        for h in holders {
            assert!(
                offered.iter().any(|d| d.id == h.device),
                "{}: {} is not offered: {offered:?}",
                self.what,
                h.device
            );
            let ids = [h.device.clone()];
            self.kubelet
                .allocate(RESOURCE, &ids)
                .await
                .unwrap_or_else(|e| {
                    panic!("{}: Allocate {}: {e}\n{}", self.what, h.device, self.log())
                });
            self.kubelet
                .assign(&h.namespace, &h.name, "main", RESOURCE, &ids);
        }
    }

    pub fn scrape(&self) -> Option<String> {
        match support::http_get(self.metrics, "/metrics") {
            Some((200, body)) => Some(body),
            _ => None,
        }
    }

    /// Waits until /metrics shows every MIG device held by its pod in the ledger and, with
    /// telemetry on, every device's readings and every container's use attributed.
    pub async fn wait_ready(&self, holders: usize, telemetry: bool) {
        let deadline = Instant::now() + WAIT;
        let mut seen = String::new();
        loop {
            if let Some(body) = self.scrape() {
                let held = samples(&body)
                    .filter(|l| {
                        l.starts_with("gpuplane_ledger_held_units{")
                            && l.contains("api=\"device-plugin\"")
                    })
                    .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                    .sum::<f64>();
                let attributed = |family: &str| {
                    samples(&body)
                        .filter(|l| {
                            l.starts_with(family)
                                && l.contains("api=\"device-plugin\"")
                                && l.contains("pod=\"train-")
                                && l.contains("container=\"main\"")
                        })
                        .count()
                };
                let ready = held == holders as f64
                    && (!telemetry
                        || (attributed("gpuplane_container_gpu_memory_used_bytes{") == holders
                            && attributed("gpuplane_device_up{") == holders));
                if ready {
                    return;
                }
                let memory_lines: Vec<&str> = samples(&body)
                    .filter(|l| l.starts_with("gpuplane_container_gpu_memory_used_bytes{"))
                    .take(2)
                    .collect();
                seen = format!(
                    "held {held}, attributed memory {}, device_up {} of {holders}; {memory_lines:?}",
                    attributed("gpuplane_container_gpu_memory_used_bytes{"),
                    attributed("gpuplane_device_up{")
                );
            }
            assert!(
                Instant::now() < deadline,
                "{}: not ready within {WAIT:?} ({seen})\n{}",
                self.what,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.kubelet.stop().await;
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
