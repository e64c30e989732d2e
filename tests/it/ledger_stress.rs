//! The allocation ledger under stress: thousands of random interleavings of device-plugin pod
//! admissions, pod ends, NodePrepare and NodeUnprepare, with agent restarts in between, through
//! the real gRPC interfaces. After every step, what the two APIs have handed out is checked from
//! the outside: no unit (GPU or MIG device, or a MIG device and its parent) is held by two
//! consumers, and every refusal was for a held device.

use crate::lab;

use crate::lab::{overlapping, Lab, Rng, WAIT};
use gpuplane_model::inventory::Inventory;
use gpuplane_model::source::DeviceSource;
use gpuplane_node::dra::ClaimRef;
use std::collections::BTreeMap;

/// Everything handed out right now, by consumer: pods through the device plugin (by the
/// kubelet double's record) and prepared claims (by our record of successful prepares).
fn check_invariant(
    inv: &Inventory,
    pods: &BTreeMap<String, Vec<String>>,
    claims: &BTreeMap<String, (ClaimRef, Vec<String>)>,
    step: usize,
) {
    let mut holder_of: BTreeMap<String, String> = BTreeMap::new();
    let consumers = pods
        .iter()
        .map(|(p, units)| (format!("pod {p}"), units.clone()))
        .chain(
            claims
                .iter()
                .map(|(n, (_, units))| (format!("claim {n}"), units.clone())),
        );
    for (who, units) in consumers {
        for u in units {
            for o in overlapping(inv, &u) {
                if let Some(other) = holder_of.get(&o) {
                    assert_eq!(other, &who, "step {step}: {o} held by {other} and by {who}");
                }
            }
            holder_of.insert(u, who.clone());
        }
    }
}

async fn stress(profile: &str, config: &str, steps: usize, seed: u64) {
    let lab = Lab::new(profile).await;
    let inv = lab.sim.discover().unwrap().inventory;
    let dra_devices: Vec<(String, String)> = inv
        .dra_devices()
        .iter()
        .map(|d| (d.dra_name(), d.uuid().to_string()))
        .collect();
    let unit_of_dra: BTreeMap<String, String> = dra_devices.iter().cloned().collect();
    let mut agent = lab.start(config);
    let mut rng = Rng(seed);
    let mut pods: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut claims: BTreeMap<String, (ClaimRef, Vec<String>)> = BTreeMap::new();
    let (mut granted, mut refused, mut restarts) = (0usize, 0usize, 0usize);
    lab.dra.wait_registered(lab::DRIVER, WAIT).await.unwrap();
    let resources: Vec<String> = lab
        .kubelet
        .wait_for(WAIT, |p| !p.is_empty())
        .await
        .unwrap()
        .keys()
        .cloned()
        .collect();
    for step in 0..steps {
        match rng.below(10) {
            0..=2 => {
                let resource = resources[rng.below(resources.len())].clone();
                let name = format!("p{step}");
                match lab
                    .kubelet
                    .admit("team-b", &name, "main", &resource, 1 + rng.below(2))
                    .await
                {
                    Ok((ids, _)) => {
                        granted += 1;
                        pods.insert(name, ids);
                    }
                    Err(e) if e.code() == tonic::Code::ResourceExhausted => {} // the kubelet found nothing free
                    Err(e) => {
                        refused += 1;
                        assert!(
                            e.message().contains("held by"),
                            "step {step}: Allocate refused for another reason: {}",
                            e.message()
                        );
                    }
                }
            }
            3..=4 => {
                if let Some(name) = pods.keys().nth(rng.below(pods.len())).cloned() {
                    lab.kubelet.end_pod("team-b", &name);
                    pods.remove(&name);
                }
            }
            5..=7 => {
                let n = 1 + rng.below(2);
                let mut names: Vec<&str> = (0..n)
                    .map(|_| dra_devices[rng.below(dra_devices.len())].0.as_str())
                    .collect();
                names.sort();
                names.dedup();
                let name = format!("c{step}");
                let claim = lab.claim(&name, &names);
                match lab.prepare(&claim).await {
                    Ok(_) => {
                        granted += 1;
                        claims.insert(
                            name,
                            (
                                claim,
                                names.iter().map(|d| unit_of_dra[*d].clone()).collect(),
                            ),
                        );
                    }
                    Err(e) => {
                        refused += 1;
                        assert!(
                            e.contains("held by"),
                            "step {step}: prepare refused for another reason: {e}"
                        );
                    }
                }
            }
            8 => {
                if let Some(name) = claims.keys().nth(rng.below(claims.len())).cloned() {
                    let (claim, _) = claims.remove(&name).unwrap();
                    lab.unprepare(&claim).await;
                }
            }
            _ => {
                if rng.below(30) == 0 {
                    let before = lab.dra.registrations().len();
                    agent.stop().await;
                    agent = lab.start(config);
                    // The restarted agent's own registration, not the stale one of its predecessor.
                    lab.dra
                        .wait_until(WAIT, "re-registration", |k| {
                            k.registrations().len() > before && k.plugin(lab::DRIVER).is_some()
                        })
                        .await
                        .unwrap();
                    lab.kubelet.wait_for(WAIT, |p| !p.is_empty()).await.unwrap();
                    restarts += 1;
                }
            }
        }
        // Device IDs are UUIDs (the default strategy): the unit a pod holds is its ID.
        let pod_units: BTreeMap<String, Vec<String>> = pods.clone();
        check_invariant(&inv, &pod_units, &claims, step);
    }
    agent.stop().await;
    println!("{profile}: {steps} steps, {granted} granted, {refused} refused for held devices, {restarts} agent restarts");
    assert!(
        granted > steps / 10 && refused > 0,
        "the run must exercise both outcomes ({granted} granted, {refused} refused)"
    );
    assert!(restarts > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_interleavings_on_a100_mig_mixed_never_hand_a_device_out_twice() {
    stress(
        "a100-mig-mixed",
        "flags: {migStrategy: mixed}\nallocation: {podResourcesGrace: 1s}\n",
        1500,
        0x9e37_79b9_7f4a_7c15,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_interleavings_on_dgx_h100_never_hand_a_device_out_twice() {
    stress(
        "dgx-h100",
        "allocation: {podResourcesGrace: 1s}\n",
        1500,
        0x2545_f491_4f6c_dd1d,
    )
    .await;
}
