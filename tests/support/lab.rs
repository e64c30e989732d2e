//! A lab for end-to-end tests of the agent with DRA: the real agent in process on simulated
//! hardware, the API server double over HTTP (real kube client), and the kubelet doubles for
//! DRA and the device plugin over unix sockets, all in one temp dir. Shared by several test
//! crates; each uses a part of it.
#![allow(dead_code)]

use gpuplane::doubles::apiserver::ApiServerDouble;
use gpuplane::doubles::kubelet::KubeletDouble;
use gpuplane::doubles::kubelet_dra::{KubeletDraDouble, KubeletDraOptions};
use gpuplane::dra::ClaimRef;
use gpuplane::node::dra::DraSettings;
use gpuplane::node::{NodeOptions, NodePaths};
use gpuplane::source::{DeviceSource, SimSource};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const DRIVER: &str = "gpu.gpuplane.dev";
pub const NODE: &str = "node-a";
pub const WAIT: Duration = Duration::from_secs(15);

pub struct Agent {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), gpuplane::node::NodeError>>,
}

impl Agent {
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.unwrap().unwrap();
    }
}

pub struct Lab {
    pub dir: tempfile::TempDir,
    pub api: ApiServerDouble,
    pub kubelet: KubeletDouble,
    pub dra: KubeletDraDouble,
    pub sim: SimSource,
}

fn make_dev_nodes(dev: &Path, gpus: usize) {
    std::fs::create_dir_all(dev).unwrap();
    let mut names: Vec<String> = (0..gpus).map(|i| format!("nvidia{i}")).collect();
    names.extend(["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"].map(String::from));
    for n in names {
        std::fs::write(dev.join(n), "").unwrap();
    }
}

impl Lab {
    pub async fn new(profile: &str) -> Lab {
        Lab::with_kubelet(profile, KubeletDraOptions::default()).await
    }

    /// A lab whose DRA kubelet double negotiates as `options` say (e.g. v1beta1 only).
    pub async fn with_kubelet(profile: &str, options: KubeletDraOptions) -> Lab {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kubelet");
        let api = ApiServerDouble::start().await.unwrap();
        let kubelet = KubeletDouble::start(&root).await.unwrap();
        let dra = KubeletDraDouble::start(&root, options);
        let sim = SimSource::new(gpuplane::sim::load(profile).unwrap());
        make_dev_nodes(
            &dir.path().join("dev"),
            sim.discover().unwrap().inventory.gpus.len(),
        );
        Lab {
            dir,
            api,
            kubelet,
            dra,
            sim,
        }
    }

    pub fn start(&self, config: &str) -> Agent {
        let d = self.dir.path();
        let cfg = d.join("config.yaml");
        std::fs::write(&cfg, config).unwrap();
        let opts = NodeOptions {
            node_name: NODE.into(),
            paths: NodePaths {
                kubelet_root: d.join("kubelet"),
                cdi_root: d.join("cdi"),
                state_dir: d.join("state"),
                driver_root: d.join("driver"),
                dev_root: d.join("dev"),
            },
            config_file: Some(cfg),
            device_plugin: true,
            dra: Some(DraSettings {
                driver_name: DRIVER.into(),
                client: self.api.client().unwrap(),
            }),
            metrics_addr: None,
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let source: Arc<dyn DeviceSource> = Arc::new(self.sim.clone());
        let task = tokio::spawn(gpuplane::node::run(opts, source, async {
            let _ = stopped.await;
        }));
        Agent {
            stop: Some(stop),
            task,
        }
    }

    pub fn slices(&self) -> Vec<Value> {
        self.api
            .list_json("resource.k8s.io/v1", "resourceslices", None)
    }

    pub fn device<'a>(slices: &'a [Value], name: &str) -> Option<&'a Value> {
        slices
            .iter()
            .flat_map(|s| {
                s["spec"]["devices"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .map(move |d| (s, d))
            })
            .find(|(_, d)| d["name"] == name)
            .map(|(s, _)| s)
    }

    pub fn taints(&self, device: &str) -> Vec<String> {
        let slices = self.slices();
        let mut out = Vec::new();
        for s in &slices {
            for d in s["spec"]["devices"].as_array().into_iter().flatten() {
                if d["name"] == device {
                    for t in d["taints"].as_array().into_iter().flatten() {
                        out.push(format!(
                            "{}={}",
                            t["key"].as_str().unwrap_or(""),
                            t["value"].as_str().unwrap_or("")
                        ));
                    }
                }
            }
        }
        out
    }

    pub async fn eventually(&self, what: &str, check: impl Fn(&Lab) -> bool) {
        let deadline = std::time::Instant::now() + WAIT;
        while !check(self) {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A claim allocated by the (absent) scheduler to `devices` of this node's pool.
    pub fn claim(&self, name: &str, devices: &[&str]) -> ClaimRef {
        let results: Vec<Value> = devices
            .iter()
            .map(|d| json!({"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d}))
            .collect();
        let obj = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.gpuplane.dev", "count": devices.len()}}]}},
            "status": {"allocation": {"devices": {"results": results}}}
        });
        let stored = self.api.put_json(obj).unwrap();
        ClaimRef {
            namespace: "team-a".into(),
            name: name.into(),
            uid: stored["metadata"]["uid"].as_str().unwrap().to_string(),
        }
    }

    pub async fn prepare(&self, c: &ClaimRef) -> Result<Vec<String>, String> {
        let mut out = self
            .dra
            .prepare(DRIVER, std::slice::from_ref(c))
            .await
            .map_err(|s| s.message().to_string())?;
        out.remove(&c.uid)
            .unwrap()
            .map(|devs| devs.into_iter().flat_map(|d| d.cdi_ids).collect())
    }

    pub async fn unprepare(&self, c: &ClaimRef) {
        let mut out = self
            .dra
            .unprepare(DRIVER, std::slice::from_ref(c))
            .await
            .unwrap();
        out.remove(&c.uid).unwrap().unwrap();
    }
}
