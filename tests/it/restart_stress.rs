//! Agent restarts at random moments while pods of both APIs come and go (issue 22). The real
//! binary (`gpuplane node --simulate a100-mig-mixed`, MIG devices and their parent GPUs
//! overlapping) runs against the kubelet doubles and the API server double and is SIGKILLed at
//! random points: once settled, or a random few hundred milliseconds into its start-up, with
//! pods ending while it is away or not. A "scheduler" picks claims' devices only from what the
//! published ResourceSlices offer (no in-use taint), some of them right after a restart.
//!
//! Checked from the outside, on every step:
//! - every version of every ResourceSlice the API server stored (a watch sees each write)
//!   carries the in-use taint on each device that overlaps a unit a device-plugin pod held
//!   throughout: no write ever dropped a taint it should carry;
//! - no claim is allocated a device a device-plugin pod holds, and every such claim prepares;
//! - a restart with nothing changed makes no API write at all, however many start-ups it took;
//! - a pod that ends before any PodResources listing saw it frees its device (the slice drops
//!   the taint) without waiting out a long grace period;
//! - no ListAndWatch answer of a restarted agent offers as Healthy a device that overlaps a
//!   claim prepared throughout the restart (the mirror rule: DRA's checkpoint holds are in
//!   the ledger before the device plugin registers).

use crate::support;

use crate::lab::{overlapping, Lab, Rng};
use crate::support::AgentProcess;
use gpuplane_model::inventory::Inventory;
use gpuplane_model::source::DeviceSource;
use gpuplane_node::dra::ClaimRef;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

const PROFILE: &str = "a100-mig-mixed";
const CONFIG: &str = "flags: {migStrategy: mixed}\n";
const IN_USE: &str = "gpu.gpuplane.dev/device-plugin=in-use";
/// A hang guard, never a timing assertion.
const WAIT: Duration = Duration::from_secs(30);
const ROUNDS: usize = 24;

/// The machine: DRA device name <-> unit UUID, and which units overlap.
struct Machine {
    inv: Inventory,
    unit_of: BTreeMap<String, String>,
}

impl Machine {
    fn overlapping(&self, unit: &str) -> BTreeSet<String> {
        overlapping(&self.inv, unit)
    }

    /// DRA device names that must carry the in-use taint while `units` are held by pods.
    fn tainted_for(&self, units: impl IntoIterator<Item = String>) -> BTreeSet<String> {
        let blocked: BTreeSet<String> = units
            .into_iter()
            .flat_map(|u| self.overlapping(&u))
            .collect();
        self.unit_of
            .iter()
            .filter(|(_, u)| blocked.contains(*u))
            .map(|(n, _)| n.clone())
            .collect()
    }
}

/// Every ResourceSlice version the API server double stored, in order, as a watch saw them.
/// The watch ends when this is dropped (the double goes away with the test).
struct SliceLog {
    seen: Arc<Mutex<Vec<Value>>>,
    watch: tokio::task::JoinHandle<()>,
}

impl Drop for SliceLog {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

impl SliceLog {
    fn start(client: kube::Client) -> SliceLog {
        let seen: Arc<Mutex<Vec<Value>>> = Arc::default();
        let sink = seen.clone();
        let watch = tokio::spawn(async move {
            let api: kube::Api<ResourceSlice> = kube::Api::all(client);
            // Backing off: once the double is gone at the end, errors must not spin.
            let events = watcher::watcher(api, watcher::Config::default()).default_backoff();
            let mut events = std::pin::pin!(events);
            while let Some(e) = events.next().await {
                if let Ok(Event::Apply(s) | Event::InitApply(s)) = e {
                    sink.lock().unwrap().push(serde_json::to_value(s).unwrap());
                }
            }
        });
        SliceLog { seen, watch }
    }

    fn len(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Devices that lack the in-use taint in a version stored after the first `from`.
    fn untainted_since(&self, from: usize) -> Vec<(String, String)> {
        let seen = self.seen.lock().unwrap();
        let mut out = Vec::new();
        for s in &seen[from.min(seen.len())..] {
            let version = s["metadata"]["resourceVersion"].as_str().unwrap_or("");
            for d in s["spec"]["devices"].as_array().into_iter().flatten() {
                let tainted = d["taints"].as_array().into_iter().flatten().any(|t| {
                    format!(
                        "{}={}",
                        t["key"].as_str().unwrap_or(""),
                        t["value"].as_str().unwrap_or("")
                    ) == IN_USE
                });
                if !tainted {
                    out.push((
                        d["name"].as_str().unwrap_or("").to_string(),
                        version.to_string(),
                    ));
                }
            }
        }
        out
    }
}

/// A pod the kubelet double admitted: its resource and the unit it holds.
struct Pod {
    unit: String,
}

struct Stress {
    lab: Lab,
    machine: Machine,
    rng: Rng,
    agent: Option<AgentProcess>,
    starts: usize,
    pods: BTreeMap<String, Pod>,
    claims: BTreeMap<String, (ClaimRef, Vec<String>)>,
    slices: SliceLog,
    seq: usize,
}

impl Stress {
    fn spawn(&mut self) {
        self.starts += 1;
        let tag = format!("start-{}", self.starts);
        self.agent = Some(AgentProcess::spawn(
            self.lab.dir.path(),
            CONFIG,
            &["--simulate", PROFILE],
            &[],
            &tag,
        ));
    }

    fn kill(&mut self) {
        if let Some(a) = self.agent.take() {
            a.kill();
        }
    }

    fn log(&self) -> String {
        self.agent
            .as_ref()
            .map(|a| a.log_text())
            .unwrap_or_default()
    }

    /// Devices the published slices carry the in-use taint on.
    fn published_taints(&self) -> BTreeSet<String> {
        self.machine
            .unit_of
            .keys()
            .filter(|n| self.lab.taints(n).iter().any(|t| t == IN_USE))
            .cloned()
            .collect()
    }

    fn expected_taints(&self) -> BTreeSet<String> {
        self.machine
            .tainted_for(self.pods.values().map(|p| p.unit.clone()))
    }

    /// The agent serves both APIs and the slices show exactly the device plugin's holds.
    async fn settle(&self, what: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let ready = self
                .agent
                .as_ref()
                .and_then(|a| a.get("/readyz"))
                .is_some_and(|(code, _)| code == 200);
            if ready && self.published_taints() == self.expected_taints() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: never settled: ready {ready}, tainted {:?}, expected {:?}\n{}",
                self.published_taints(),
                self.expected_taints(),
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until the kubelet doubles have the running agent's registrations.
    async fn registered(&self, dp_before: usize, dra_before: usize) {
        self.lab
            .kubelet
            .wait_for(WAIT, |p| !p.is_empty())
            .await
            .unwrap();
        let deadline = Instant::now() + WAIT;
        while self.lab.kubelet.registrations().len() <= dp_before
            || self.lab.dra.registrations().len() <= dra_before
        {
            assert!(
                Instant::now() < deadline,
                "no re-registration\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        self.lab
            .kubelet
            .wait_for(WAIT, |p| !p.is_empty())
            .await
            .unwrap();
    }

    /// A device-plugin pod with one device of a random resource; `end_at_once`: it ends before
    /// any PodResources listing can have seen it.
    async fn admit(&mut self, end_at_once: bool) {
        let resources: Vec<String> = self.lab.kubelet.plugins().keys().cloned().collect();
        let resource = resources[self.rng.below(resources.len())].clone();
        self.seq += 1;
        let name = format!("p{}", self.seq);
        match self
            .lab
            .kubelet
            .admit("team-b", &name, "main", &resource, 1)
            .await
        {
            Ok((ids, _)) => {
                // Device IDs are UUIDs (the default strategy): the ID is the unit.
                if end_at_once {
                    self.lab.kubelet.end_pod("team-b", &name);
                } else {
                    self.pods.insert(
                        name,
                        Pod {
                            unit: ids[0].clone(),
                        },
                    );
                }
            }
            Err(e) if e.code() == tonic::Code::ResourceExhausted => {}
            Err(e) => assert!(
                e.message().contains("held by"),
                "Allocate refused for another reason: {}",
                e.message()
            ),
        }
    }

    fn end_pod(&mut self) {
        if let Some(name) = self
            .pods
            .keys()
            .nth(self.rng.below(self.pods.len()))
            .cloned()
        {
            self.lab.kubelet.end_pod("team-b", &name);
            self.pods.remove(&name);
        }
    }

    /// The scheduler's part: a device the published slices offer (no taint of any kind) and
    /// that no live claim overlaps; the claim must prepare, and its device must not be one a
    /// device-plugin pod holds.
    async fn schedule_claim(&mut self) {
        let claimed = self.claimed_units();
        let offered: Vec<String> = self
            .machine
            .unit_of
            .iter()
            .filter(|(n, u)| self.lab.taints(n).is_empty() && !claimed.contains(*u))
            .map(|(n, _)| n.clone())
            .collect();
        if offered.is_empty() {
            return;
        }
        let device = offered[self.rng.below(offered.len())].clone();
        let unit = self.machine.unit_of[&device].clone();
        let held: BTreeSet<String> = self
            .pods
            .values()
            .flat_map(|p| self.machine.overlapping(&p.unit))
            .collect();
        assert!(
            !held.contains(&unit),
            "the slices offered {device} ({unit}), which a device-plugin pod holds\n{}",
            self.log()
        );
        self.seq += 1;
        let name = format!("c{}", self.seq);
        let claim = self.lab.claim(&name, &[&device]);
        let deadline = Instant::now() + WAIT;
        loop {
            match self.lab.prepare(&claim).await {
                Ok(_) => break,
                Err(e) if e.contains("held by") => {
                    panic!(
                        "claim {name} on offered {device} refused: {e}\n{}",
                        self.log()
                    )
                }
                // The kubelet retries a prepare the agent cannot answer yet (restarting, or
                // not knowing the device plugin's holds yet).
                Err(e) => {
                    assert!(Instant::now() < deadline, "{name}: {e}\n{}", self.log());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        self.claims.insert(name, (claim, vec![unit]));
    }

    async fn unprepare_claim(&mut self) {
        if let Some(name) = self
            .claims
            .keys()
            .nth(self.rng.below(self.claims.len()))
            .cloned()
        {
            let (claim, _) = self.claims.remove(&name).unwrap();
            self.lab.unprepare(&claim).await;
        }
    }

    /// Units that overlap a unit some prepared claim holds.
    fn claimed_units(&self) -> BTreeSet<String> {
        self.claims
            .values()
            .flat_map(|(_, units)| units.iter().flat_map(|u| self.machine.overlapping(u)))
            .collect()
    }

    /// ListAndWatch answers from the `from`-th on that offer one of `units` as Healthy
    /// (device IDs are unit UUIDs under the default strategy): (resource, device ID).
    fn offered_since(&self, from: usize, units: &BTreeSet<String>) -> Vec<(String, String)> {
        let answers = self.lab.kubelet.answers();
        answers[from.min(answers.len())..]
            .iter()
            .flat_map(|(resource, devices)| {
                devices
                    .iter()
                    .filter(|d| d.health == "Healthy" && units.contains(&d.id))
                    .map(move |d| (resource.clone(), d.id.clone()))
            })
            .collect()
    }

    /// Writes the API server double has received, but those on claims (the status a
    /// prepare or unprepare writes, in the background): what a restart alone could cause.
    fn writes(&self) -> Vec<(String, String)> {
        self.lab
            .api
            .requests()
            .into_iter()
            .filter(|(m, p)| {
                ["POST", "PUT", "PATCH", "DELETE"].contains(&m.as_str())
                    && !p.contains("/resourceclaims/")
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_at_random_moments_never_drop_a_taint_or_hand_a_held_device_to_a_claim() {
    let lab = Lab::new(PROFILE).await;
    support::write_kubeconfig(lab.dir.path(), &lab.api.url());
    let inv = lab.sim.discover().unwrap().inventory;
    let unit_of = inv
        .dra_devices()
        .iter()
        .map(|d| (d.dra_name(), d.uuid().to_string()))
        .collect();
    let slices = SliceLog::start(lab.api.client().unwrap());
    let mut s = Stress {
        lab,
        machine: Machine { inv, unit_of },
        rng: Rng(0x2545_f491_4f6c_dd1d),
        agent: None,
        starts: 0,
        pods: BTreeMap::new(),
        claims: BTreeMap::new(),
        slices,
        seq: 0,
    };
    s.spawn();
    s.registered(0, 0).await;
    s.settle("first start").await;
    let (mut quiet_restarts, mut startup_kills, mut offered_after_restart) = (0, 0, 0);
    for round in 0..ROUNDS {
        for _ in 0..1 + s.rng.below(4) {
            match s.rng.below(6) {
                0 | 1 => s.admit(false).await,
                2 => s.admit(true).await,
                3 => s.end_pod(),
                4 => s.schedule_claim().await,
                _ => s.unprepare_claim().await,
            }
            s.settle(&format!("round {round}")).await;
        }

        // A restart: SIGKILL, maybe pods end while the agent is away, maybe a start-up is
        // itself killed partway.
        let quiet = s.rng.below(2) == 0;
        let (writes, seen) = (s.writes().len(), s.slices.len());
        let held_throughout: BTreeSet<String> = s.expected_taints();
        let (dp_before, dra_before) = (
            s.lab.kubelet.registrations().len(),
            s.lab.dra.registrations().len(),
        );
        let (answered, claimed_throughout) = (s.lab.kubelet.answers().len(), s.claimed_units());
        s.kill();
        if !quiet && !s.pods.is_empty() {
            s.end_pod();
        }
        let held_throughout: BTreeSet<String> = held_throughout
            .intersection(&s.expected_taints())
            .cloned()
            .collect();
        for _ in 0..s.rng.below(3) {
            s.spawn();
            tokio::time::sleep(Duration::from_millis(s.rng.below(600) as u64)).await;
            s.kill();
            startup_kills += 1;
        }
        s.spawn();
        s.registered(dp_before, dra_before).await;
        if !quiet {
            // Right away, as the scheduler would on a slice event: what is offered now?
            s.schedule_claim().await;
            offered_after_restart += 1;
        }
        s.settle(&format!("round {round} after the restart")).await;
        let lost: Vec<(String, String)> = s
            .slices
            .untainted_since(seen)
            .into_iter()
            .filter(|(d, _)| held_throughout.contains(d))
            .collect();
        assert!(
            lost.is_empty(),
            "round {round}: slices written without the in-use taint of a held device (device, resourceVersion): {lost:?}\n{}",
            s.log()
        );
        let offered = s.offered_since(answered, &claimed_throughout);
        assert!(
            offered.is_empty(),
            "round {round}: ListAndWatch offered devices a prepared claim holds (resource, device): {offered:?}\n{}",
            s.log()
        );
        if quiet {
            quiet_restarts += 1;
            let after = s.writes();
            assert!(
                after.len() == writes,
                "round {round}: a restart with nothing changed wrote to the API server: {:?}\n{}",
                &after[writes.min(after.len())..],
                s.log()
            );
        }
    }
    s.kill();
    println!(
        "{ROUNDS} rounds, {} agent starts ({startup_kills} killed during start-up), {quiet_restarts} quiet restarts with no write, {offered_after_restart} claims scheduled right after a restart",
        s.starts
    );
    assert!(quiet_restarts > 0 && startup_kills > 0 && offered_after_restart > 0);
}
