//! A lab for end-to-end tests of the agent with DRA: the library's `NodeLab` (the real agent in
//! process on simulated hardware, the API server double over HTTP, the kubelet doubles over
//! unix sockets) in a temp dir, with test-style helpers that panic on failure. Shared by several
//! test crates; each uses a part of it.
#![allow(dead_code)]

use gpuplane_model::inventory::Inventory;
use gpuplane_model::source::SimSource;
use gpuplane_node::dra::ClaimRef;
use gpuplane_testkit::doubles::kubelet_dra::KubeletDraOptions;
use gpuplane_testkit::doubles::lab::{NodeLab, RunningAgent};
use serde_json::Value;
use std::collections::BTreeSet;
use std::ops::Deref;
use std::time::Duration;

// Each test crate uses some of these.
#[allow(unused_imports)]
pub use gpuplane_testkit::doubles::lab::{DRIVER, NODE};
pub const WAIT: Duration = Duration::from_secs(15);

pub struct Agent(RunningAgent);

impl Agent {
    pub async fn stop(self) {
        self.0.stop().await.unwrap();
    }

    /// Waits (at most [`WAIT`]) for the agent to end by itself; its result, errors as text.
    pub async fn ended(self) -> Result<(), String> {
        let deadline = std::time::Instant::now() + WAIT;
        while !self.0.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "the agent did not end"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.0.stop().await.map_err(|e| e.to_string())
    }
}

/// Fields drop in order: the doubles stop before the temp dir goes.
pub struct Lab {
    node: NodeLab,
    pub dir: tempfile::TempDir,
}

impl Deref for Lab {
    type Target = NodeLab;
    fn deref(&self) -> &NodeLab {
        &self.node
    }
}

impl std::ops::DerefMut for Lab {
    fn deref_mut(&mut self) -> &mut NodeLab {
        &mut self.node
    }
}

impl Lab {
    pub async fn new(profile: &str) -> Lab {
        Lab::with_kubelet(profile, KubeletDraOptions::default()).await
    }

    /// A lab whose DRA kubelet double negotiates as `options` say (e.g. v1beta1 only).
    pub async fn with_kubelet(profile: &str, options: KubeletDraOptions) -> Lab {
        let dir = tempfile::tempdir().unwrap();
        let sim = SimSource::new(gpuplane_model::sim::load(profile).unwrap());
        let node = NodeLab::start(dir.path(), sim, options).await.unwrap();
        Lab { node, dir }
    }

    pub fn start(&self, config: &str) -> Agent {
        Agent(self.node.start_agent(config).unwrap())
    }

    /// [`Lab::start`], also serving `/metrics`, `/healthz` and `/readyz` on `metrics`.
    pub fn start_serving(&self, config: &str, metrics: std::net::SocketAddr) -> Agent {
        Agent(
            self.node
                .start_agent_serving(config, Some(metrics))
                .unwrap(),
        )
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

    /// Waits (at most [`WAIT`]) until `check` holds of this lab.
    pub async fn eventually(&self, what: &str, check: impl Fn(&Lab) -> bool) {
        crate::support::eventually(what, WAIT, || check(self)).await;
    }

    /// A claim in `team-a` allocated by the (absent) scheduler to `devices` of this node's pool.
    pub fn claim(&self, name: &str, devices: &[&str]) -> ClaimRef {
        self.node.claim("team-a", name, devices).unwrap()
    }

    /// A claim in `team-a` allocated a share (`memory`, `compute` percent) of `device`.
    pub fn share_claim(&self, name: &str, device: &str, memory: &str, compute: u32) -> ClaimRef {
        self.node
            .share_claim("team-a", name, device, memory, compute)
            .expect("store share claim")
    }

    pub async fn prepare(&self, c: &ClaimRef) -> Result<Vec<String>, String> {
        self.node
            .prepare(c)
            .await
            .map(|devs| devs.into_iter().flat_map(|d| d.cdi_ids).collect())
    }

    pub async fn unprepare(&self, c: &ClaimRef) {
        self.node.unprepare(c).await.unwrap();
    }
}

/// A tiny deterministic PRNG (xorshift64*), so a failing seed can be replayed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Units that overlap `unit`: itself and its MIG parent or children.
pub fn overlapping(inv: &Inventory, unit: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::from([unit.to_string()]);
    for g in &inv.gpus {
        let migs: Vec<&str> = g.mig_devices.iter().map(|m| m.uuid.as_str()).collect();
        if g.uuid == unit {
            out.extend(migs.iter().map(|m| m.to_string()));
        } else if migs.contains(&unit) {
            out.insert(g.uuid.to_string());
        }
    }
    out
}
