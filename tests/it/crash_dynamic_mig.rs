//! Crash consistency of dynamic MIG: the real agent binary on the fake libnvidia-ml (whose MIG
//! instances outlive the agent in a state file, as a real driver's do) is killed with SIGKILL
//! at every step of a dynamic MIG claim's life, restarted, and checked from the outside: after
//! the restart and the kubelet's retry, the GPU has exactly the instances the prepared claims
//! need, each claim holds its instance as its device, and once every claim is unprepared the GPU
//! has none (tests/it/crash.rs does the same for whole devices; the node is
//! tests/support/crash_node.rs).

#![cfg(feature = "crashpoints")]

use crate::support;

use crate::crash_node::Node;
use gpuplane_node::dra::ClaimRef;
use serde_json::Value;

/// GPUs 0 and 1 are H100s in MIG mode with no instances; GPU 3 an L4, the one device the
/// device plugin offers (`flags.migStrategy: none`).
const PROFILE: &str = "dynamic-mig-mixed";
const CONFIG: &str = "dynamicMig:\n  gpus: [0, 1]\n";
const DEVICE: &str = "gpu-0-mig-3g40gb-at4";

async fn node() -> Node {
    let mut node = Node::with_fake_nvml(PROFILE, CONFIG).await;
    node.dp_devices = 1;
    node
}

/// (profile, start, uuid) of GPU `gpu`'s MIG instances, as the fake driver holds them.
fn instances(node: &Node, gpu: usize) -> Vec<(String, u64, String)> {
    let Ok(text) = std::fs::read_to_string(node.path("fake-nvml-state.json")) else {
        return Vec::new();
    };
    let state: Value = serde_json::from_str(&text).unwrap();
    state["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["uuid"] == node.uuids[gpu])
        .and_then(|g| g["migDevices"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .map(|m| {
            (
                m["profile"].as_str().unwrap().to_string(),
                m["placement"]["start"].as_u64().unwrap(),
                m["uuid"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn claim(node: &Node, name: &str) -> ClaimRef {
    support::put_claim(&node.api, name, &[DEVICE])
}

/// The claim is prepared with exactly one instance on GPU 0, the one its CDI spec names.
async fn check_prepared(node: &Node, c: &ClaimRef) {
    node.prepare(c)
        .await
        .unwrap_or_else(|e| panic!("the retried prepare: {e}\n{}", node.log()));
    let made = instances(node, 0);
    assert_eq!(made.len(), 1, "exactly one instance: {made:?}");
    assert_eq!((made[0].0.as_str(), made[0].1), ("3g.40gb", 4));
    let spec = std::fs::read_to_string(node.spec_path(c)).unwrap();
    assert!(
        spec.contains(&format!("{}-{DEVICE}", c.uid)),
        "the spec has the claim's device: {spec}"
    );
    let entry = node.checkpoint().claims[c.uid.as_str()].clone();
    assert_eq!(
        entry.units.get(DEVICE).map(|u| u.to_string()),
        Some(made[0].2.clone()),
        "the claim holds the instance as its unit"
    );
    assert_eq!(
        entry.instances[0]
            .created
            .as_ref()
            .map(|m| m.uuid.to_string()),
        Some(made[0].2.clone())
    );
}

/// Unprepared: no instance, no entry, no spec.
async fn check_unprepared(node: &Node, c: &ClaimRef) {
    node.unprepare(c).await.unwrap();
    assert!(instances(node, 0).is_empty(), "no instance is left");
    assert!(!node.checkpoint().claims.contains_key(c.uid.as_str()));
    assert!(!node.spec_path(c).exists());
}

/// Kill in prepare at `step`, restart, retry: the instance is there once, and goes with the
/// claim.
async fn crash_in_prepare(step: &str, created_before_kill: bool) {
    let mut node = node().await;
    node.start(Some(step)).await;
    let c = claim(&node, "train");
    node.prepare_until_crash(&c).await;
    assert_eq!(
        instances(&node, 0).len(),
        usize::from(created_before_kill),
        "{step}: what the kill left on the GPU"
    );
    node.check_files(false);
    node.start(None).await;
    node.check_files(true);
    check_prepared(&node, &c).await;
    check_unprepared(&node, &c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_recording_the_intent_the_retry_creates_the_instance() {
    crash_in_prepare("prepare.after-mig-intent", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_creating_and_recording_the_retry_adopts_the_instance() {
    crash_in_prepare("prepare.after-mig-create", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_checkpoint_the_prepared_claim_keeps_its_instance() {
    crash_in_prepare("prepare.after-checkpoint", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_final_checkpoint_the_retry_completes_with_the_recorded_instance() {
    crash_in_prepare("prepare.before-checkpoint", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_spec_the_retry_answers_the_same_instance() {
    crash_in_prepare("prepare.after-cdi-spec", true).await;
}

/// Prepare, kill in unprepare at `step`, restart, retry the unprepare: the instance and the
/// entry go, and the GPU is whole again (a whole-GPU claim is prepared as its full instance).
async fn crash_in_unprepare(step: &str, destroyed_before_kill: bool, entry_left: bool) {
    let mut node = node().await;
    node.start(Some(step)).await;
    let c = claim(&node, "train");
    check_prepared(&node, &c).await;
    node.unprepare_until_crash(&c).await;
    assert_eq!(
        instances(&node, 0).is_empty(),
        destroyed_before_kill,
        "{step}: what the kill left on the GPU"
    );
    assert_eq!(
        node.checkpoint().claims.contains_key(c.uid.as_str()),
        entry_left,
        "{step}: whether the entry still records the claim"
    );
    node.check_files(false);
    node.start(None).await;
    node.check_files(true);
    check_unprepared(&node, &c).await;
    let whole = support::put_claim(&node.api, "whole", &["gpu-0"]);
    node.prepare(&whole).await.unwrap();
    let made = instances(&node, 0);
    assert_eq!(made.len(), 1);
    assert_eq!((made[0].0.as_str(), made[0].1), ("7g.80gb", 0));
    node.unprepare(&whole).await.unwrap();
    assert!(instances(&node, 0).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_spec_removal_the_retried_unprepare_destroys_the_instance() {
    crash_in_unprepare("unprepare.before-spec-removal", false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_spec_removal_the_retried_unprepare_destroys_the_instance() {
    crash_in_unprepare("unprepare.after-spec-removal", false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_destroying_and_recording_the_retried_unprepare_finishes() {
    crash_in_unprepare("unprepare.after-mig-destroy", true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_checkpoint_the_unprepare_is_done() {
    crash_in_unprepare("unprepare.after-checkpoint", true, false).await;
}
