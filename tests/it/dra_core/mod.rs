//! The DRA core driven through the `DraDriver` trait: simulated hardware (`a100-mig-mixed`),
//! ResourceClaims served from memory, CDI specs, checkpoint and device nodes in a temp dir.
//!
//! Most tests run the core as on real hardware (`DeviceMode::Hardware`): the device nodes are
//! character devices with the NVIDIA driver's numbers, made with mknod, so they need root and
//! skip without it. The simulated mode needs no nodes.

use gpuplane_model::config::AgentConfig;
use gpuplane_model::inventory::{DeviceRef, Inventory};
use gpuplane_model::source::{DeviceMode, SimSource};
use gpuplane_node::cdi::Spec;
use gpuplane_node::dra::checkpoint::{self, CheckpointData, ClaimEntry, ClaimState};
use gpuplane_node::dra::core::{spec_stem, DraCore, DraCoreConfig};
use gpuplane_node::dra::fetch::ClaimFetcher;
use gpuplane_node::dra::service::kubelet_error;
use gpuplane_node::dra::{ClaimRef, ClaimUid, DeviceHealthState, DraDriver, PreparedDevice};
use gpuplane_node::paths::HostPaths;
use gpuplane_node::state::{NodeState, Snapshot};
use gpuplane_testkit::doubles::claims::MemoryClaims;
use gpuplane_testkit::doubles::devnodes;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

mod prepare;
mod recovery;

const DRIVER: &str = "gpu.gpuplane.dev";
const NODE: &str = "node-a";
const KIND: &str = "k8s.gpu.gpuplane.dev/claim";

fn uid(n: u8) -> String {
    format!("0b5c3f2e-1111-4222-8333-4444555566{n:02x}")
}

struct Env {
    _dir: tempfile::TempDir,
    root: PathBuf,
    inv: Inventory,
    state: Arc<NodeState>,
    claims: Arc<MemoryClaims>,
    mode: DeviceMode,
}

impl Env {
    /// As on real hardware, with every device node in place; `None` (the test skips) where
    /// this process cannot make device nodes.
    fn new() -> Option<Env> {
        if !devnodes::can_make_nodes() {
            eprintln!("SKIPPED: making device nodes (mknod) needs root");
            return None;
        }
        let env = Env::bare(DeviceMode::Hardware);
        // Device nodes, and MIG access capabilities with their minors under a fake /proc.
        let dev = env.root.join("dev");
        devnodes::make_gpu_nodes(&dev, env.inv.gpus.iter().map(|g| g.minor)).unwrap();
        let mut minors = String::new();
        let mut next = 100;
        for g in &env.inv.gpus {
            for m in &g.mig_devices {
                for key in [
                    format!("gpu{}/gi{}/access", g.minor, m.gpu_instance_id),
                    format!(
                        "gpu{}/gi{}/ci{}/access",
                        g.minor, m.gpu_instance_id, m.compute_instance_id
                    ),
                ] {
                    minors.push_str(&format!("{key} {next}\n"));
                    devnodes::make_cap_node(&dev, next).unwrap();
                    next += 1;
                }
            }
        }
        let caps = env.root.join("proc/driver/nvidia-caps");
        fs::create_dir_all(&caps).unwrap();
        fs::write(caps.join("mig-minors"), minors).unwrap();
        Some(env)
    }

    /// No device nodes at all: what a simulated node (`gpuplane node --simulate`) has.
    fn simulated() -> Env {
        Env::bare(DeviceMode::Simulated)
    }

    fn bare(mode: DeviceMode) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let inv = gpuplane_model::sim::load("a100-mig-mixed").unwrap();
        fs::create_dir_all(root.join("driver")).unwrap();
        fs::create_dir_all(root.join("proc/sys/kernel/random")).unwrap();
        fs::write(root.join("proc/sys/kernel/random/boot_id"), "boot-1\n").unwrap();
        let snapshot = Snapshot::new(inv.clone(), AgentConfig::default()).unwrap();
        Env {
            _dir: dir,
            root,
            inv,
            state: Arc::new(NodeState::new(snapshot)),
            claims: Arc::new(MemoryClaims::default()),
            mode,
        }
    }

    fn config(&self) -> DraCoreConfig {
        DraCoreConfig {
            driver: DRIVER.into(),
            node_name: NODE.into(),
            paths: HostPaths::under(&self.root),
            device_mode: self.mode,
            mps: None,
            memory_limits: None,
        }
    }

    fn core(&self) -> AsKubelet {
        let fetcher: Arc<dyn ClaimFetcher> = self.claims.clone();
        let source = Arc::new(SimSource::new(self.inv.clone()));
        AsKubelet(DraCore::new(self.config(), self.state.clone(), fetcher, source).unwrap())
    }

    fn cdi(&self) -> PathBuf {
        self.root.join("cdi")
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        let uid = ClaimUid::parse(uid).unwrap();
        self.cdi().join(format!("{}.json", spec_stem(&uid)))
    }

    fn spec(&self, uid: &str) -> Spec {
        serde_json::from_slice(&fs::read(self.spec_path(uid)).unwrap()).unwrap()
    }

    fn checkpoint_path(&self) -> PathBuf {
        self.root.join("state").join(checkpoint::FILE_NAME)
    }

    fn checkpoint(&self) -> CheckpointData {
        checkpoint::read(&self.root.join("state")).expect("a usable checkpoint slot")
    }

    fn mig(&self, i: usize) -> String {
        self.inv
            .dra_devices()
            .into_iter()
            .filter(|d| matches!(d, gpuplane_model::inventory::DeviceRef::Mig { .. }))
            .nth(i)
            .unwrap()
            .dra_name()
    }

    /// Adds an allocated claim `ns/<name>` with `results` (request, device) and `config`.
    fn add_claim(
        &self,
        name: &str,
        uid: &str,
        results: &[(&str, &str)],
        config: Value,
    ) -> ClaimRef {
        let results: Vec<Value> = results
            .iter()
            .map(|(r, d)| json!({"request": r, "driver": DRIVER, "pool": NODE, "device": d}))
            .collect();
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap();
        self.claims.insert(claim);
        cref(name, uid)
    }
}

fn cref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef::parse("ns", uid, name).unwrap()
}

fn mtimes(dir: &Path) -> BTreeMap<String, std::time::SystemTime> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().unwrap().modified().unwrap(),
            )
        })
        .collect()
}

/// The core with its answers as the kubelet gets them: each typed error made the kubelet's
/// string the way the gRPC edge makes it ([`kubelet_error`]), keyed by UID.
struct AsKubelet(DraCore);

impl std::ops::Deref for AsKubelet {
    type Target = DraCore;
    fn deref(&self) -> &DraCore {
        &self.0
    }
}

type Answers<T> = BTreeMap<String, Result<T, String>>;

/// Each answer with its error as the kubelet reads it.
fn as_kubelet<T, E: std::fmt::Display>(
    claims: &[ClaimRef],
    answers: BTreeMap<ClaimUid, Result<T, E>>,
) -> Answers<T> {
    answers
        .into_iter()
        .map(|(uid, r)| {
            let c = claims.iter().find(|c| c.uid == uid).expect("a claim asked");
            (uid.to_string(), r.map_err(|e| kubelet_error(c, &e)))
        })
        .collect()
}

impl AsKubelet {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> Answers<Vec<PreparedDevice>> {
        as_kubelet(&claims, DraDriver::prepare(&self.0, claims.clone()).await)
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Answers<()> {
        as_kubelet(&claims, DraDriver::unprepare(&self.0, claims.clone()).await)
    }
}

fn devices(r: &Result<Vec<PreparedDevice>, String>) -> &[PreparedDevice] {
    r.as_ref().unwrap()
}
