//! What the DRA benchmarks share: the node lab in a temp dir with its waits and claim calls,
//! the floor of a prepare, and the rows for write counts.

use super::{NS, WAIT};
use gpuplane_model::source::SimSource;
use gpuplane_node::dra::ClaimRef;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use gpuplane_testkit::doubles::kubelet_dra::KubeletDraOptions;
use gpuplane_testkit::doubles::lab::{NodeLab, RunningAgent, DRIVER};
use k8s_openapi::api::resource::v1::ResourceClaim;
use std::collections::BTreeMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const FILE_MODE: u32 = 0o644;

pub fn count_row(what: &str, writes: usize, floor: usize, floor_what: &str) {
    let ratio = if floor == 0 {
        if writes == 0 {
            "ratio    -  (must be 0: ok)".to_string()
        } else {
            "ratio    -  (must be 0: NOT 0)".to_string()
        }
    } else {
        format!("ratio {:>5.2}x", writes as f64 / floor as f64)
    };
    println!("{what:<56} {writes:>5} writes | floor {floor:>3} ({floor_what}) | {ratio}");
}

/// The writes the API server double logged, grouped as `METHOD path` with object names elided.
pub fn write_breakdown(api: &ApiServerDouble) -> String {
    let mut groups: BTreeMap<String, usize> = BTreeMap::new();
    for (method, path) in api.requests() {
        if !matches!(method.as_str(), "POST" | "PUT" | "PATCH" | "DELETE") {
            continue;
        }
        let path = path.split('?').next().unwrap_or_default();
        let path = match method.as_str() {
            "POST" => path.to_string(),
            _ => match path.rsplit_once('/') {
                Some((collection, _)) => format!("{collection}/{{name}}"),
                None => path.to_string(),
            },
        };
        *groups.entry(format!("{method} {path}")).or_default() += 1;
    }
    if groups.is_empty() {
        return "none".into();
    }
    groups
        .iter()
        .map(|(k, n)| format!("{k} x{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The library's `NodeLab` in a temp dir (fields drop in order: the doubles stop first).
pub struct Lab {
    pub node: NodeLab,
    pub dir: tempfile::TempDir,
}

impl Deref for Lab {
    type Target = NodeLab;
    fn deref(&self) -> &NodeLab {
        &self.node
    }
}

impl Lab {
    pub async fn new(profile: &str) -> Lab {
        let dir = tempfile::tempdir().expect("temp dir");
        let sim = SimSource::new(gpuplane_model::sim::load(profile).expect("profile"));
        let node = NodeLab::start(dir.path(), sim, KubeletDraOptions::default())
            .await
            .expect("lab");
        Lab { node, dir }
    }

    /// Starts an agent and waits until both kubelet doubles saw it register anew (the doubles
    /// may still hold the previous agent's registrations).
    pub async fn start_registered(
        &self,
        config: &str,
        plugin_devices: usize,
    ) -> (RunningAgent, PathBuf) {
        let dra_before = self.dra.registrations().len();
        let dp_before = self.kubelet.registrations().len();
        let agent = self.start_agent(config).expect("agent");
        let deadline = Instant::now() + WAIT;
        while self.dra.registrations().len() <= dra_before
            || self.dra.plugin(DRIVER).is_none()
            || self.kubelet.registrations().len() <= dp_before
        {
            assert!(Instant::now() < deadline, "the agent did not register");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let view = self
            .kubelet
            .wait_for(WAIT, |p| {
                p.get("nvidia.com/gpu").is_some_and(|v| {
                    v.devices.len() == plugin_devices && v.healthy() == plugin_devices
                })
            })
            .await
            .expect("device plugin devices");
        (agent, view["nvidia.com/gpu"].endpoint.clone())
    }

    pub fn published_devices(&self) -> usize {
        self.slices()
            .iter()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum()
    }

    pub fn tainted(&self, device: &str) -> bool {
        self.slices().iter().any(|s| {
            s["spec"]["devices"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|d| {
                    d["name"] == device && d["taints"].as_array().is_some_and(|t| !t.is_empty())
                })
        })
    }

    pub async fn eventually(&self, what: &str, check: impl Fn(&Lab) -> bool) {
        let deadline = Instant::now() + WAIT;
        while !check(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A claim in [`NS`] allocated by the (absent) scheduler to `devices` of this node's pool.
    pub fn claim(&self, name: &str, devices: &[&str]) -> ClaimRef {
        self.node.claim(NS, name, devices).expect("store claim")
    }

    pub async fn prepare(&self, claims: &[ClaimRef]) {
        let out = self
            .dra
            .prepare(DRIVER, claims)
            .await
            .expect("NodePrepareResources");
        for (uid, r) in out {
            if let Err(e) = r {
                panic!("prepare of {uid} failed: {e}");
            }
        }
    }

    pub async fn unprepare(&self, claims: &[ClaimRef]) {
        let out = self
            .dra
            .unprepare(DRIVER, claims)
            .await
            .expect("NodeUnprepareResources");
        for (uid, r) in out {
            if let Err(e) = r {
                panic!("unprepare of {uid} failed: {e}");
            }
        }
    }

    pub fn spec_path(&self, c: &ClaimRef) -> PathBuf {
        self.dir
            .path()
            .join(format!("cdi/gpuplane-claim-{}.json", c.uid))
    }
}

/// The floor of a prepare: GET each claim with the real kube client, then one fsync'd atomic
/// write of `bytes` per claim into the same temp dir. Returns (GETs, writes).
pub async fn floor_once(
    claims: &kube::Api<ResourceClaim>,
    refs: &[ClaimRef],
    dir: &Path,
    bytes: &[u8],
) -> (Duration, Duration) {
    let t = Instant::now();
    for c in refs {
        std::hint::black_box(claims.get(&c.name).await.expect("GET claim"));
    }
    let gets = t.elapsed();
    let t = Instant::now();
    for i in 0..refs.len() {
        gpuplane_node::fsutil::write_atomic(&dir.join(format!("floor-{i}.json")), bytes, FILE_MODE)
            .expect("floor write");
    }
    (gets, t.elapsed())
}
