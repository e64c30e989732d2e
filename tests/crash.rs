//! Crash consistency: the real agent binary is killed with SIGKILL at every step of prepare,
//! unprepare, the CDI spec and checkpoint writes and slice publication, restarted, and checked
//! from the outside. A crash point (`GPUPLANE_CRASHPOINT`, crates/shell/src/crashpoint.rs) only chooses
//! where the kill lands: the agent stops there, writes a marker, and the test kills it.
//!
//! After every kill: every `*.json` in the CDI root is a whole CDI spec and the checkpoint
//! decodes (nobody can read half a file); after the restart no temporary file is left and no
//! checkpoint was set aside as corrupt. Then: the units the checkpoint lists are held again
//! (withdrawn from ListAndWatch, counted in `gpuplane_ledger_held_units`, refused to Allocate
//! and to another claim), a retried prepare answers exactly the devices the claim was
//! allocated, an unprepare leaves no CDI spec and no checkpoint entry and frees every unit,
//! and a pool whose publication was cut is completed by the next agent.

#![cfg(feature = "crashpoints")]

mod support;

use gpuplane_shell::dra::checkpoint::{self, CheckpointData, ClaimState};
use gpuplane_shell::dra::ClaimRef;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use gpuplane_testkit::doubles::kubelet_dra::{KubeletDraDouble, KubeletDraOptions};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use support::{eventually, AgentProcess, DRIVER, NODE};

/// A hang guard for waits, never a timing assertion.
const WAIT: Duration = Duration::from_secs(30);
const PROFILE: &str = "dgx-h100";
const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// One node: a directory, the doubles in this process and the agent as a child process.
struct Node {
    dir: tempfile::TempDir,
    api: ApiServerDouble,
    kubelet: Arc<KubeletDouble>,
    dra: Arc<KubeletDraDouble>,
    agent: Option<AgentProcess>,
    /// GPU index -> UUID (the device plugin's device IDs).
    uuids: Vec<String>,
    /// Devices the device plugin offers for `nvidia.com/gpu` (GPUs, or MIG devices).
    dp_devices: usize,
    profile: String,
    config: String,
    runs: usize,
}

impl Node {
    async fn new(profile: &str, config: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let api = ApiServerDouble::start().await.unwrap();
        let kubelet_root = dir.path().join("kubelet");
        let kubelet = Arc::new(KubeletDouble::start(&kubelet_root).await.unwrap());
        let dra = Arc::new(KubeletDraDouble::start(
            &kubelet_root,
            KubeletDraOptions::default(),
        ));
        let uuids: Vec<String> = gpuplane_shell::sim::load(profile)
            .unwrap()
            .gpus
            .iter()
            .map(|g| g.uuid.to_string())
            .collect();
        support::lay_out_node(dir.path(), uuids.len(), &api.url());
        Node {
            dir,
            api,
            kubelet,
            dra,
            agent: None,
            dp_devices: uuids.len(),
            uuids,
            profile: profile.to_string(),
            config: config.to_string(),
            runs: 0,
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn marker(&self) -> PathBuf {
        self.path("crashpoint-reached")
    }

    /// Starts the agent, armed at `crash` if given, without waiting for anything.
    fn spawn(&mut self, crash: Option<&str>) {
        assert!(self.agent.is_none(), "an agent is running");
        self.runs += 1;
        let _ = std::fs::remove_file(self.marker());
        let marker = self.marker().into_os_string();
        let spec = crash.map(std::ffi::OsString::from);
        let mut env: Vec<(&str, &std::ffi::OsStr)> =
            vec![("GPUPLANE_CRASHPOINT_MARKER", marker.as_os_str())];
        if let Some(s) = &spec {
            env.push(("GPUPLANE_CRASHPOINT", s.as_os_str()));
        }
        let profile = self.profile.clone();
        self.agent = Some(AgentProcess::spawn(
            self.dir.path(),
            &self.config,
            &["--simulate", &profile],
            &env,
            &self.runs.to_string(),
        ));
    }

    /// Starts the agent and waits until both kubelet doubles have it registered anew, with
    /// ListAndWatch answering from the new process.
    async fn start(&mut self, crash: Option<&str>) {
        let dra_before = self.dra_registrations();
        let dp_before = self.kubelet.registrations().len();
        self.spawn(crash);
        let what = format!(
            "agent run {} to register with both kubelet doubles",
            self.runs
        );
        let (dra, kubelet) = (self.dra.clone(), self.kubelet.clone());
        let gpus = self.dp_devices;
        let ok = tokio::time::timeout(WAIT, async {
            dra.wait_until(WAIT, "a new DRA registration", |k| {
                registrations_ok(k) > dra_before && k.plugin(DRIVER).is_some()
            })
            .await?;
            kubelet
                .wait_for(WAIT, |p| {
                    p.get(GPU_RESOURCE).is_some_and(|v| v.devices.len() == gpus)
                })
                .await?;
            Ok::<_, String>(())
        })
        .await;
        let registered = matches!(ok, Ok(Ok(()))) && self.kubelet.registrations().len() > dp_before;
        assert!(registered, "{what}: {ok:?}\n{}", self.log());
    }

    fn dra_registrations(&self) -> usize {
        registrations_ok(&self.dra)
    }

    fn log(&self) -> String {
        self.agent
            .as_ref()
            .map(AgentProcess::log_text)
            .unwrap_or_default()
    }

    async fn wait_marker(&self) {
        let marker = self.marker();
        let log = self.agent.as_ref().map(|a| a.log.clone()).unwrap();
        eventually("the crash point", WAIT, || marker.exists()).await;
        assert!(
            std::fs::read_to_string(&log)
                .unwrap()
                .contains("crash point reached"),
            "the agent logged where it stopped"
        );
    }

    /// SIGKILL, then wait until the device plugin double saw its stream end.
    async fn kill(&mut self) {
        self.agent.take().expect("a running agent").kill();
        let kubelet = self.kubelet.clone();
        eventually("the kubelet double to notice the dead plugin", WAIT, || {
            kubelet
                .plugin(GPU_RESOURCE)
                .is_none_or(|v| v.devices.iter().all(|d| d.health == "Unhealthy"))
        })
        .await;
    }

    /// Calls NodePrepareResources for `c`, expects the agent to stop at its armed crash point
    /// instead of answering, and kills it there.
    async fn prepare_until_crash(&mut self, c: &ClaimRef) {
        let dra = self.dra.clone();
        let claim = c.clone();
        let call = tokio::spawn(async move { dra.prepare(DRIVER, &[claim]).await });
        self.wait_marker().await;
        assert!(!call.is_finished(), "prepare answered past the crash point");
        self.kill().await;
        let answer = call.await.unwrap();
        assert!(answer.is_err(), "a killed agent answered: {answer:?}");
    }

    async fn unprepare_until_crash(&mut self, c: &ClaimRef) {
        let dra = self.dra.clone();
        let claim = c.clone();
        let call = tokio::spawn(async move { dra.unprepare(DRIVER, &[claim]).await });
        self.wait_marker().await;
        assert!(
            !call.is_finished(),
            "unprepare answered past the crash point"
        );
        self.kill().await;
        assert!(call.await.unwrap().is_err());
    }

    /// A claim allocated by the (absent) scheduler to GPUs `gpus` of this node.
    fn claim(&self, name: &str, gpus: &[usize]) -> ClaimRef {
        let devices: Vec<String> = gpus.iter().map(|g| format!("gpu-{g}")).collect();
        let devices: Vec<&str> = devices.iter().map(String::as_str).collect();
        support::put_claim(&self.api, name, &devices)
    }

    /// The CDI IDs NodePrepareResources answered for `c`, or the claim's error.
    async fn prepare(&self, c: &ClaimRef) -> Result<Vec<String>, String> {
        let mut out = self
            .dra
            .prepare(DRIVER, std::slice::from_ref(c))
            .await
            .map_err(|s| s.message().to_string())?;
        let mut ids: Vec<String> = out
            .remove(c.uid.as_str())
            .unwrap()?
            .into_iter()
            .flat_map(|d| d.cdi_ids)
            .collect();
        ids.sort();
        Ok(ids)
    }

    async fn unprepare(&self, c: &ClaimRef) -> Result<(), String> {
        let mut out = self
            .dra
            .unprepare(DRIVER, std::slice::from_ref(c))
            .await
            .map_err(|s| s.message().to_string())?;
        out.remove(c.uid.as_str()).unwrap()
    }

    fn spec_path(&self, c: &ClaimRef) -> PathBuf {
        self.path(&format!("cdi/gpuplane-claim-{}.json", c.uid))
    }

    /// The newest checkpoint slot (check_files checks that every slot decodes).
    fn checkpoint(&self) -> CheckpointData {
        checkpoint::read(&self.path("state")).unwrap_or_else(|| CheckpointData::empty(""))
    }

    /// Nobody can read half a file: every spec a runtime would load (`*.json`) is a whole CDI
    /// spec, and the checkpoint decodes (checksum included). With `restarted`, also: no
    /// temporary file is left and nothing was set aside as corrupt.
    fn check_files(&self, restarted: bool) {
        for dir in ["cdi", "state"] {
            for entry in std::fs::read_dir(self.path(dir)).into_iter().flatten() {
                let entry = entry.unwrap();
                let name = entry.file_name().to_string_lossy().into_owned();
                let bytes = std::fs::read(entry.path()).unwrap();
                if name.starts_with('.') {
                    assert!(name.contains(".tmp-"), "unexpected hidden file {name}");
                    assert!(!restarted, "{name} left behind after the restart");
                } else if dir == "cdi" {
                    assert!(name.ends_with(".json"), "{name}");
                    let spec: gpuplane_shell::cdi::Spec = serde_json::from_slice(&bytes)
                        .unwrap_or_else(|e| panic!("{name} is not a whole CDI spec: {e}"));
                    assert!(!spec.devices.is_empty(), "{name} has no devices");
                } else if name == gpuplane_shell::node::lock::FILE_NAME {
                    // The one-agent lock (node/lock.rs); it holds a PID, not state.
                } else {
                    assert!(
                        checkpoint::SLOTS.contains(&name.as_str()),
                        "{name}: nothing set aside as corrupt"
                    );
                    checkpoint::decode(&bytes).expect("each checkpoint slot decodes");
                }
            }
        }
    }

    /// The ledger from the outside: exactly the GPUs in `held` are withdrawn from ListAndWatch
    /// (the rest healthy), `gpuplane_ledger_held_units{api="dra"}` counts them, Allocate of
    /// the first is refused naming `holder`, and so is another claim for it.
    async fn check_ledger(&self, held: &[usize], holder: &str) {
        let want: BTreeSet<String> = held.iter().map(|g| self.uuids[*g].clone()).collect();
        let kubelet = self.kubelet.clone();
        let gpus = self.uuids.len();
        let seen = kubelet
            .wait_for(WAIT, |p| {
                p.get(GPU_RESOURCE).is_some_and(|v| {
                    v.devices.len() == gpus
                        && v.devices
                            .iter()
                            .all(|d| (d.health == "Unhealthy") == want.contains(&d.id))
                })
            })
            .await;
        assert!(
            seen.is_ok(),
            "ListAndWatch withdraws exactly {held:?}: {seen:?}"
        );
        let agent = self.agent.as_ref().unwrap();
        let metric = r#"gpuplane_ledger_held_units{api="dra"}"#;
        eventually("the held-units metric", WAIT, || {
            agent.metric(metric) == Some(held.len() as f64)
        })
        .await;
        let Some(first) = held.first() else { return };
        let err = self
            .kubelet
            .allocate(GPU_RESOURCE, &[self.uuids[*first].clone()])
            .await
            .unwrap_err();
        assert!(
            err.message()
                .contains(&format!("ResourceClaim team-a/{holder}")),
            "{}",
            err.message()
        );
        let probe = self.claim(&format!("probe-{}", self.runs), &[*first]);
        let err = self.prepare(&probe).await.unwrap_err();
        assert!(err.contains("held by"), "{err}");
    }

    /// The unit holds the checkpoint on disk implies for `c`: its GPUs if listed, else none.
    fn held_by_checkpoint(&self, c: &ClaimRef, gpus: &[usize]) -> Vec<usize> {
        if self.checkpoint().claims.contains_key(c.uid.as_str()) {
            gpus.to_vec()
        } else {
            Vec::new()
        }
    }

    /// After an unprepare: no spec, no checkpoint entry, every unit free and a new claim for
    /// the same GPUs is prepared.
    async fn check_gone(&self, c: &ClaimRef, gpus: &[usize]) {
        assert!(
            !self.spec_path(c).exists(),
            "the CDI spec of an unprepared claim is gone"
        );
        assert!(!self.checkpoint().claims.contains_key(c.uid.as_str()));
        self.check_ledger(&[], "").await;
        let next = self.claim(&format!("next-{}", self.runs), gpus);
        assert_eq!(self.prepare(&next).await.unwrap(), cdi_ids(&next, gpus));
    }
}

fn registrations_ok(k: &KubeletDraDouble) -> usize {
    k.registrations()
        .iter()
        .filter(|r| r.driver == DRIVER && r.outcome.is_ok())
        .count()
}

/// What a prepare of `c` must answer: one CDI device per allocated GPU.
fn cdi_ids(c: &ClaimRef, gpus: &[usize]) -> Vec<String> {
    let mut ids: Vec<String> = gpus
        .iter()
        .map(|g| format!("k8s.{DRIVER}/claim={}-gpu-{g}", c.uid))
        .collect();
    ids.sort();
    ids
}

/// Every step a prepare passes, in order, as crash point specs, and whether an earlier claim
/// must have been prepared and unprepared first: the checkpoint's first two writes create its
/// two slot files, every later one overwrites the older slot in place.
const PREPARE_STEPS: [(&str, bool); 8] = [
    ("prepare.before-checkpoint", false),
    ("file.before-rename@dra-checkpoint", false), // creating a slot, recording the claim
    ("file.after-rename@dra-checkpoint", false),
    ("file.before-sync@dra-checkpoint", true), // overwriting a slot in place
    ("prepare.after-checkpoint", false),
    ("file.before-rename@gpuplane-claim-", false), // the claim's CDI spec file
    ("file.after-rename@gpuplane-claim-", false),
    ("prepare.after-cdi-spec", false),
];

const CLAIMED: [usize; 2] = [2, 5];

/// Kills the agent at `step` of a prepare of a new claim and restarts it; checks the files and
/// that the checkpoint's holds are back. Returns the node (agent running) and the claim.
async fn crash_in_prepare((step, warm): (&str, bool)) -> (Node, ClaimRef) {
    let mut node = Node::new(PROFILE, "").await;
    node.start(Some(step)).await;
    if warm {
        let w = node.claim("warm-up", &CLAIMED);
        assert_eq!(node.prepare(&w).await, Ok(cdi_ids(&w, &CLAIMED)), "{step}");
        node.unprepare(&w).await.unwrap();
    }
    let c = node.claim("train", &CLAIMED);
    node.prepare_until_crash(&c).await;
    node.check_files(false);
    node.start(None).await;
    node.check_files(true);
    let held = node.held_by_checkpoint(&c, &CLAIMED);
    node.check_ledger(&held, "train").await;
    (node, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_any_step_of_prepare_then_the_retried_prepare_answers_the_allocated_devices() {
    for (step, warm) in PREPARE_STEPS {
        let (node, c) = crash_in_prepare((step, warm)).await;
        let completed = node
            .checkpoint()
            .claims
            .get(c.uid.as_str())
            .is_some_and(|e| e.state == ClaimState::PrepareCompleted);
        let before = std::fs::metadata(node.spec_path(&c))
            .and_then(|m| m.modified())
            .ok();
        assert!(
            !completed || before.is_some(),
            "{step}: the restarted agent restored the spec its checkpoint records"
        );
        assert_eq!(node.prepare(&c).await, Ok(cdi_ids(&c, &CLAIMED)), "{step}");
        if completed {
            let after = std::fs::metadata(node.spec_path(&c))
                .and_then(|m| m.modified())
                .ok();
            assert_eq!(
                before, after,
                "{step}: a completed claim is answered, not rewritten"
            );
        }
        let entry = node.checkpoint().claims[c.uid.as_str()].clone();
        assert_eq!(entry.state, ClaimState::PrepareCompleted, "{step}");
        let spec: gpuplane_shell::cdi::Spec =
            serde_json::from_slice(&std::fs::read(node.spec_path(&c)).unwrap()).unwrap();
        let mut names: Vec<String> = spec.devices.iter().map(|d| d.name.clone()).collect();
        names.sort();
        assert_eq!(
            names,
            CLAIMED.map(|g| format!("{}-gpu-{g}", c.uid)),
            "{step}: the spec names the claim's devices"
        );
        node.check_ledger(&CLAIMED, "train").await;
        node.unprepare(&c).await.unwrap();
        node.check_gone(&c, &CLAIMED).await;
        node.check_files(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_any_step_of_prepare_then_unprepare_leaves_no_spec_and_frees_the_devices() {
    for (step, warm) in PREPARE_STEPS {
        let (node, c) = crash_in_prepare((step, warm)).await;
        node.unprepare(&c)
            .await
            .unwrap_or_else(|e| panic!("{step}: {e}"));
        node.check_gone(&c, &CLAIMED).await;
        node.check_files(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_any_step_of_unprepare_then_the_retried_unprepare_leaves_no_trace() {
    let steps = [
        "unprepare.before-spec-removal",
        "unprepare.after-spec-removal",
        // The prepare wrote the checkpoint once; the unprepare's write is the second, which
        // creates the second slot.
        "file.before-rename@dra-checkpoint#2",
        "file.after-rename@dra-checkpoint#2",
        "unprepare.after-checkpoint",
    ];
    for step in steps {
        let mut node = Node::new(PROFILE, "").await;
        node.start(Some(step)).await;
        let c = node.claim("train", &CLAIMED);
        assert_eq!(node.prepare(&c).await, Ok(cdi_ids(&c, &CLAIMED)));
        node.unprepare_until_crash(&c).await;
        node.check_files(false);
        node.start(None).await;
        node.check_files(true);
        let held = node.held_by_checkpoint(&c, &CLAIMED);
        node.check_ledger(&held, "train").await;
        node.unprepare(&c)
            .await
            .unwrap_or_else(|e| panic!("{step}: {e}"));
        node.check_gone(&c, &CLAIMED).await;
        node.check_files(true);
    }
}

/// A DGX H100 with every GPU in MIG mode, doubled to 16 GPUs: 112 MIG devices, two slices.
fn sixteen_gpu_profile(dir: &Path) -> PathBuf {
    let text = gpuplane_shell::sim::bundled_text("h100-mig-single").unwrap();
    let (head, rest) = text.split_once("gpus:\n").unwrap();
    let (gpus, _) = rest.split_once("topology:\n").unwrap();
    let more = gpus.replace("pciBusId: \"00000000:", "pciBusId: \"00000001:");
    let path = dir.join("sixteen.yaml");
    std::fs::write(
        &path,
        format!("{head}gpus:\n{gpus}{more}topology:\n  nvswitch: true\n"),
    )
    .unwrap();
    path
}

/// This node's slices as the API server double holds them.
fn pool(api: &ApiServerDouble) -> Vec<Value> {
    api.list_json("resource.k8s.io/v1", "resourceslices", None)
        .into_iter()
        .filter(|s| s["spec"]["nodeName"] == NODE)
        .collect()
}

/// Whether the pool is complete: as many slices as each claims, one generation, valid, with
/// `devices` devices in all.
fn complete(slices: &[Value], devices: usize) -> bool {
    let count = slices.len() as i64;
    let generations: BTreeSet<i64> = slices
        .iter()
        .map(|s| s["spec"]["pool"]["generation"].as_i64().unwrap_or(-1))
        .collect();
    let total: usize = slices
        .iter()
        .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
        .sum();
    !slices.is_empty()
        && generations.len() == 1
        && slices
            .iter()
            .all(|s| s["spec"]["pool"]["resourceSliceCount"].as_i64() == Some(count))
        && total == devices
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_slice_writes_leaves_a_pool_the_next_agent_completes() {
    let scratch = tempfile::tempdir().unwrap();
    let profile = sixteen_gpu_profile(scratch.path());
    let mut node = Node::new(profile.to_str().unwrap(), "flags: {migStrategy: single}\n").await;
    node.dp_devices = 112;

    // First publication: two creates; killed after the first.
    node.spawn(Some("slices.after-write"));
    node.wait_marker().await;
    node.agent.take().unwrap().kill();
    let cut = pool(&node.api);
    assert_eq!(cut.len(), 1, "one slice of two was written");
    assert!(
        !complete(&cut, 112),
        "consumers see an incomplete pool and ignore it"
    );
    node.start(None).await;
    let api = &node.api;
    eventually("the whole pool", WAIT, || complete(&pool(api), 112)).await;
    for s in pool(&node.api) {
        let slice: k8s_openapi::api::resource::v1::ResourceSlice =
            serde_json::from_value(s).unwrap();
        gpuplane_shell::slices::validate::validate(&slice).unwrap();
    }
    node.kill().await;

    // The pool shrinks to 56 devices in one slice: a new generation, an update and a delete;
    // killed after the update.
    node.config = "flags: {migStrategy: single}\nallocation: {mode: partitioned, draGpus: [0, 1, 2, 3, 4, 5, 6, 7]}\n".into();
    node.spawn(Some("slices.after-write"));
    node.wait_marker().await;
    node.agent.take().unwrap().kill();
    assert!(!complete(&pool(&node.api), 56) && !complete(&pool(&node.api), 112));
    node.spawn(None);
    let api = &node.api;
    eventually("the shrunk pool", WAIT, || {
        let p = pool(api);
        p.len() == 1 && complete(&p, 56)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_while_the_node_cdi_spec_is_replaced_leaves_the_old_or_the_new_one() {
    let spec = |node: &Node| std::fs::read(node.path("cdi/gpuplane-node.json")).ok();
    for (step, expect_new) in [
        ("file.before-rename@gpuplane-node", false),
        ("file.after-rename@gpuplane-node", true),
    ] {
        let mut node = Node::new("dgx-h100", "").await;
        node.start(None).await;
        let old = spec(&node).expect("the node spec is written");
        node.kill().await;
        // Another machine behind the same paths: the node spec changes.
        node.profile = "dgx-a100".into();
        node.spawn(Some(step));
        node.wait_marker().await;
        node.agent.take().unwrap().kill();
        node.check_files(false);
        let at_kill = spec(&node).unwrap();
        if expect_new {
            assert_ne!(at_kill, old, "{step}");
        } else {
            assert_eq!(at_kill, old, "{step}");
        }
        node.uuids = gpuplane_shell::sim::load("dgx-a100")
            .unwrap()
            .gpus
            .iter()
            .map(|g| g.uuid.to_string())
            .collect();
        node.start(None).await;
        node.check_files(true);
        let new = spec(&node).unwrap();
        assert_ne!(new, old, "{step}: the new machine's spec");
    }
}
