//! Quota preemption (issue 27): the time of the pure decision
//! (`controller::preempt::choose_victims`) for one Queue-mode GpuQuota with 1,000 running pods
//! of mixed priorities, sizes and start times (every 50th pair a pod group), for a waiting pod
//! that needs a few victims, one that needs hundreds, and one that is refused after trying
//! every allowed pod. p50/p99 over [`DECISIONS`] decisions each, printed next to a floor
//! measured in the same run: one fit check of the same charge against the same ledger
//! (`Working::fits`), the question the decision asks once per victim it tries.
//!
//! Run: `cargo bench --bench preempt` (results are kept in benches/results/preempt.txt).

mod common;

use common::{percentiles, row};
use gpuplane_cluster::controller::preempt::{choose_victims, Candidate, Preemption, Preemptor};
use gpuplane_cluster::controller::quota_ledger::Working;
use gpuplane_model::quota::{Charge, GpuQuota};
use serde_json::json;
use std::hint::black_box;
use std::time::{Duration, Instant, SystemTime};

const PODS: u64 = 1_000;
const DECISIONS: usize = 200;
const NS: &str = "team-a";

/// 1,000 pods of 1 or 2 GPUs, priorities 0..=9, started a second apart (every 97th not yet);
/// pods 0 and 1 of every 50 form a group. Returns them and the GPUs they hold.
fn pods() -> (Vec<Candidate>, u64) {
    let mut held = 0;
    let pods = (0..PODS)
        .map(|i| {
            let n = 1 + i % 2;
            held += n;
            Candidate {
                namespace: NS.into(),
                name: format!("p-{i:04}"),
                uid: format!("uid-{i}"),
                priority: ((i * 7) % 10) as i32,
                started: (i % 97 != 0)
                    .then(|| SystemTime::UNIX_EPOCH + Duration::from_secs(1_000 + i)),
                charge: Charge::whole_gpus(n),
                group: (i % 50 < 2).then(|| format!("g-{}", i / 50)),
                terminating: false,
            }
        })
        .collect();
    (pods, held)
}

/// The quota, full: `hard` is what the pods hold.
fn working(hard: u64) -> Working {
    let q: GpuQuota = serde_json::from_value(json!({
        "apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "default", "namespace": NS},
        "spec": {"hard": {"gpus": hard.to_string()}, "mode": "Queue",
                 "preemption": {"withinQuota": "LowerPriority"}},
        "status": {"used": {"gpus": hard.to_string()}}
    }))
    .expect("a valid GpuQuota");
    Working::new(vec![q])
}

/// Times `f` [`DECISIONS`] times (after a warm-up).
fn time<T>(mut f: impl FnMut() -> T) -> (Duration, Duration) {
    for _ in 0..10 {
        black_box(f());
    }
    let samples = (0..DECISIONS)
        .map(|_| {
            let t = Instant::now();
            black_box(f());
            t.elapsed()
        })
        .collect();
    percentiles(samples)
}

fn main() {
    let (candidates, held) = pods();
    let w = working(held);
    println!(
        "one GpuQuota (Queue, withinQuota: LowerPriority), {PODS} running pods holding {held} GPUs, \
         priorities 0-9; {DECISIONS} decisions each; floor: one Working::fits of the same charge"
    );
    // Priority 5: pods of priority 0-4 (about half) may go.
    for (what, need) in [
        ("needs 2 GPUs (a few victims)", 2),
        ("needs 400 GPUs (hundreds of victims)", 400),
        ("needs 1200 GPUs (refused after every allowed pod)", 1_200),
    ] {
        let charge = Charge::whole_gpus(need);
        let unit = Preemptor {
            namespace: NS,
            priority: 5,
            charge: &charge,
        };
        let answer = choose_victims(&unit, &w, &candidates);
        let outcome = match &answer {
            Ok(Preemption::Evict(v)) => format!("{} pods evicted", v.len()),
            Ok(other) => format!("{other:?}"),
            Err(e) => format!("refused ({})", e.kind()),
        };
        let decision = time(|| choose_victims(&unit, &w, &candidates));
        let floor = time(|| w.fits(NS, &charge));
        row(&format!("decision, {what}"), decision, floor);
        println!("{:<57}{outcome}", "");
    }
}
