//! Crash consistency: the real agent binary is killed with SIGKILL at every step of prepare,
//! unprepare, the CDI spec and checkpoint writes and slice publication, restarted, and checked
//! from the outside. A crash point (`GPUPLANE_CRASHPOINT`, crates/node/src/crashpoint.rs) only chooses
//! where the kill lands: the agent stops there, writes a marker, and the test kills it.
//!
//! After every kill: every `*.json` in the CDI root is a whole CDI spec and the checkpoint
//! decodes (nobody can read half a file); after the restart no temporary file is left and no
//! checkpoint was set aside as corrupt. Then: the units the checkpoint lists are held again
//! (withdrawn from ListAndWatch, counted in `gpuplane_ledger_held_units`, refused to Allocate
//! and to another claim), a retried prepare answers exactly the devices the claim was
//! allocated, an unprepare leaves no CDI spec and no checkpoint entry and frees every unit,
//! and a pool whose publication was cut is completed by the next agent.
//!
//! Shares and their MPS control daemons: tests/it/crash_shares.rs. The node both drive:
//! tests/support/crash_node.rs.

#![cfg(feature = "crashpoints")]

use crate::crash_node::{cdi_ids, Node, WAIT};
use crate::support::{eventually, NODE};
use gpuplane_node::dra::checkpoint::ClaimState;
use gpuplane_node::dra::ClaimRef;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const PROFILE: &str = "dgx-h100";

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
        let spec: gpuplane_node::cdi::Spec =
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
    let text = gpuplane_model::sim::bundled_text("h100-mig-single").unwrap();
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
        gpuplane_node::slices::validate::validate(&slice).unwrap();
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
        node.uuids = gpuplane_model::sim::load("dgx-a100")
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

/// A restart must not offer what DRA holds: the device plugin registers only once the DRA
/// checkpoint's holds are in the ledger. Stopped just before that load, the agent has its
/// PodResources follower listing (it starts first) but no device plugin registration; killed
/// there and started again, no ListAndWatch answer of the new runs ever offers a claimed GPU
/// as Healthy (the kubelet would hand it to a pod while the claim's containers run on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_offers_no_claimed_gpu_before_its_checkpoint_holds_are_loaded() {
    let mut node = Node::new(PROFILE, "").await;
    node.start(None).await;
    let c = node.claim("train", &CLAIMED);
    assert_eq!(node.prepare(&c).await, Ok(cdi_ids(&c, &CLAIMED)));
    node.kill().await;
    let (registered, answered) = (
        node.kubelet.registrations().len(),
        node.kubelet.answers().len(),
    );
    let lists = node.kubelet.pod_resources_lists();
    node.spawn(Some("startup.before-dra-holds"));
    node.wait_marker().await;
    // Two listings by the stopped agent: it is well past where the registrar used to start.
    let kubelet = node.kubelet.clone();
    eventually("two PodResources listings", WAIT, || {
        kubelet.pod_resources_lists() >= lists + 2
    })
    .await;
    assert_eq!(
        node.kubelet.registrations().len(),
        registered,
        "the device plugin registered before the DRA checkpoint's holds were loaded\n{}",
        node.log()
    );
    node.kill().await;
    node.start(None).await;
    node.check_ledger(&CLAIMED, "train").await;
    let held: BTreeSet<&str> = CLAIMED.iter().map(|g| node.uuids[*g].as_str()).collect();
    let offered: Vec<String> = node.kubelet.answers()[answered..]
        .iter()
        .flat_map(|(resource, devices)| {
            devices
                .iter()
                .filter(|d| d.health == "Healthy" && held.contains(d.id.as_str()))
                .map(move |d| format!("{resource} {}", d.id))
        })
        .collect();
    assert!(
        offered.is_empty(),
        "ListAndWatch offered GPUs a prepared claim holds: {offered:?}\n{}",
        node.log()
    );
}
