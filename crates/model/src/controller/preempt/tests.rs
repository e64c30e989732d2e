use super::*;
use crate::quota::GpuQuota;
use serde_json::{json, Value};
use std::time::Duration;

fn quota(ns: &str, hard: u64, used: u64, spec: Value) -> GpuQuota {
    let mut s = json!({"hard": {"gpus": hard.to_string()}, "mode": "Queue"});
    if let (Value::Object(a), Value::Object(b)) = (&mut s, spec) {
        a.extend(b);
    }
    serde_json::from_value(json!({
        "apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "default", "namespace": ns},
        "spec": s,
        "status": {"used": {"gpus": used.to_string()}}
    }))
    .unwrap()
}

fn within() -> Value {
    json!({"preemption": {"withinQuota": "LowerPriority"}})
}

fn reclaim(how: &str) -> Value {
    json!({"cohort": "research", "preemption": {"reclaimWithinCohort": how}})
}

/// A running pod of `ns` holding `n` GPUs, started `started` seconds after the epoch
/// (`None`: not started yet).
fn pod(ns: &str, name: &str, priority: i32, started: Option<u64>, n: u64) -> Candidate {
    Candidate {
        namespace: ns.into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        priority,
        started: started.map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s)),
        charge: Charge::whole_gpus(n),
        group: None,
        terminating: false,
    }
}

fn grouped(mut c: Candidate, group: &str) -> Candidate {
    c.group = Some(group.into());
    c
}

fn terminating(mut c: Candidate) -> Candidate {
    c.terminating = true;
    c
}

fn decide(
    quotas: Vec<GpuQuota>,
    candidates: &[Candidate],
    ns: &str,
    priority: i32,
    need: u64,
) -> Result<Preemption, NoPreemption> {
    let charge = Charge::whole_gpus(need);
    let unit = Preemptor {
        namespace: ns,
        priority,
        charge: &charge,
    };
    choose_victims(&unit, &Working::new(quotas), candidates)
}

/// `decide` in team-a's full quota of 4 GPUs (withinQuota: LowerPriority).
fn in_full_team_a(
    candidates: &[Candidate],
    priority: i32,
    need: u64,
) -> Result<Preemption, NoPreemption> {
    decide(
        vec![quota("team-a", 4, 4, within())],
        candidates,
        "team-a",
        priority,
        need,
    )
}

/// The names of the pods to evict, in the order chosen; panics on any other answer.
fn evicted(answer: Result<Preemption, NoPreemption>, candidates: &[Candidate]) -> Vec<String> {
    match answer {
        Ok(Preemption::Evict(v)) => v.iter().map(|&i| candidates[i].name.clone()).collect(),
        other => panic!("expected evictions, got {other:?}"),
    }
}

fn refusal(answer: Result<Preemption, NoPreemption>) -> NoPreemption {
    match answer {
        Err(e) => e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn within_quota_only_pods_of_lower_priority_are_evicted() {
    let q = || vec![quota("team-a", 6, 6, within())];
    let pods = [
        pod("team-a", "a", 5, Some(10), 2),
        pod("team-a", "b", 10, Some(10), 2),
        pod("team-a", "c", 1, Some(10), 2),
    ];
    assert_eq!(evicted(decide(q(), &pods, "team-a", 10, 2), &pods), ["c"]);
    assert_eq!(
        evicted(decide(q(), &pods, "team-a", 10, 4), &pods),
        ["c", "a"]
    );
    let no = refusal(decide(q(), &pods, "team-a", 10, 6));
    assert_eq!(no.kind(), "PreemptionNotEnough");
    assert_eq!(
        no.to_string(),
        "even evicting all 2 pods the policy allows (pods of team-a below priority 10; none \
         borrowed in its cohort) would leave: gpus: requested 6, used 2 of 6 in GpuQuota \
         team-a/default"
    );
}

#[test]
fn pods_of_equal_priority_are_never_evicted() {
    let pods = [pod("team-a", "peer", 5, Some(10), 4)];
    let no = refusal(in_full_team_a(&pods, 5, 1));
    assert_eq!(
        no.to_string(),
        "no running pod may be evicted for it (the policy allows pods of team-a below \
         priority 5; none borrowed in its cohort): gpus: requested 1, used 4 of 4 in GpuQuota \
         team-a/default"
    );
}

#[test]
fn lowest_priority_first_then_the_most_recently_started_and_not_started_counts_as_most_recent() {
    let q = || vec![quota("team-a", 4, 4, within())];
    let pods = [
        pod("team-a", "old", 1, Some(100), 1),
        pod("team-a", "low", 0, Some(10), 1),
        pod("team-a", "pending", 1, None, 1),
        pod("team-a", "new", 1, Some(200), 1),
    ];
    assert_eq!(evicted(decide(q(), &pods, "team-a", 9, 1), &pods), ["low"]);
    assert_eq!(
        evicted(decide(q(), &pods, "team-a", 9, 3), &pods),
        ["low", "pending", "new"]
    );
}

#[test]
fn a_victim_made_unneeded_by_a_later_bigger_one_is_spared() {
    let pods = [
        pod("team-a", "small", 0, Some(10), 1),
        pod("team-a", "big", 1, Some(10), 2),
        pod("team-a", "high", 9, Some(10), 1),
    ];
    // In order: small (1 free, not enough), then big (3 free): small is not needed then.
    assert_eq!(
        evicted(
            decide(vec![quota("team-a", 4, 4, within())], &pods, "team-a", 5, 2),
            &pods
        ),
        ["big"]
    );
}

#[test]
fn a_pod_group_is_evicted_whole_or_not_at_all() {
    let q = || vec![quota("team-a", 4, 4, within())];
    let pods = [
        grouped(pod("team-a", "train-0", 1, Some(10), 1), "train"),
        pod("team-a", "solo", 4, Some(10), 2),
        grouped(pod("team-a", "train-1", 3, Some(20), 1), "train"),
    ];
    // The group's priority is its highest member's (3): it goes first, both members, though
    // one GPU would do.
    assert_eq!(
        evicted(decide(q(), &pods, "team-a", 5, 1), &pods),
        ["train-0", "train-1"]
    );
    // Below priority 3 neither member may go, though train-0 alone is of priority 1.
    let no = refusal(decide(q(), &pods, "team-a", 2, 1));
    assert_eq!(no.kind(), "PreemptionNotEnough");
}

/// Cohort `research`: team-a (4 of 4, reclaims), team-b (6 of 4: borrows 2, pods of 2 GPUs),
/// team-c (2 of 4, lends); team-d outside the cohort. The cohort has nothing unused.
fn cohort(how: &str) -> (Vec<GpuQuota>, Vec<Candidate>) {
    let quotas = vec![
        quota("team-a", 4, 4, reclaim(how)),
        quota("team-b", 4, 6, json!({"cohort": "research"})),
        quota("team-c", 4, 2, json!({"cohort": "research"})),
        quota("team-d", 4, 4, json!({})),
    ];
    let pods = vec![
        pod("team-a", "a-own", 0, Some(10), 4),
        pod("team-b", "b1", 100, Some(10), 2),
        pod("team-b", "b2", 100, Some(20), 2),
        pod("team-b", "b3", 100, Some(30), 2),
        pod("team-c", "c1", 0, Some(10), 2),
        pod("team-d", "d1", 0, Some(10), 4),
    ];
    (quotas, pods)
}

#[test]
fn cohort_reclaim_takes_only_what_a_borrowing_quota_borrows() {
    let (quotas, pods) = cohort("Any");
    // team-a needs to borrow 2: one pod of team-b ends its borrowing; team-c lends nothing
    // (at or under its hard), team-d is outside the cohort, team-a's own pod is not allowed
    // (withinQuota: Never), whatever their priorities.
    assert_eq!(
        evicted(decide(quotas.clone(), &pods, "team-a", 10, 2), &pods),
        ["b3"]
    );
    // To borrow 4, team-b would have to go under its hard: refused.
    let no = refusal(decide(quotas, &pods, "team-a", 10, 4));
    assert_eq!(
        no.to_string(),
        "even evicting all 1 pods the policy allows (no pod of its own namespace \
         (withinQuota: Never); pods borrowing in cohort research) would leave: gpus: requested 4, \
         used 4 of 4 in GpuQuota team-a/default; cohort research has 2 unused to lend, 4 needed"
    );
}

#[test]
fn cohort_reclaim_of_lower_priority_spares_borrowers_of_equal_or_higher_priority() {
    let (quotas, pods) = cohort("LowerPriority");
    assert_eq!(
        refusal(decide(quotas.clone(), &pods, "team-a", 100, 2)).kind(),
        "PreemptionNotEnough"
    );
    assert_eq!(
        evicted(decide(quotas, &pods, "team-a", 101, 2), &pods),
        ["b3"]
    );
}

#[test]
fn never_and_reject_mode_never_preempt() {
    let pods = [pod("team-a", "low", 0, Some(10), 4)];
    let never = refusal(decide(
        vec![quota("team-a", 4, 4, json!({}))],
        &pods,
        "team-a",
        9,
        1,
    ));
    assert_eq!(never.kind(), "PreemptionDisabled");
    let reject = refusal(decide(
        vec![quota(
            "team-a",
            4,
            4,
            json!({"mode": "Reject", "preemption": {"withinQuota": "LowerPriority"}}),
        )],
        &pods,
        "team-a",
        9,
        1,
    ));
    assert_eq!(
        reject.to_string(),
        "no preemption: GpuQuota team-a/default is in Reject mode, which never preempts"
    );
    // Two quotas in the namespace: the strictest policy applies.
    let mut other = quota("team-a", 8, 4, json!({}));
    other.metadata.name = Some("other".into());
    let strictest = refusal(decide(
        vec![quota("team-a", 4, 4, within()), other],
        &pods,
        "team-a",
        9,
        1,
    ));
    assert_eq!(strictest.kind(), "PreemptionDisabled");
}

#[test]
fn a_unit_that_would_not_fit_an_empty_quota_evicts_no_one() {
    let pods = [pod("team-a", "low", 0, Some(10), 4)];
    let no = refusal(in_full_team_a(&pods, 9, 5));
    assert_eq!(
        no.to_string(),
        "evicting cannot help: gpus: requested 5, used 0 of 4 in GpuQuota team-a/default, even \
         with nothing else admitted"
    );
}

#[test]
fn a_unit_that_fits_evicts_no_one() {
    let pods = [pod("team-a", "low", 0, Some(10), 2)];
    assert_eq!(
        decide(vec![quota("team-a", 4, 2, within())], &pods, "team-a", 9, 2),
        Ok(Preemption::Fits)
    );
}

#[test]
fn pods_already_terminating_are_waited_for_and_never_chosen_again() {
    let q = || vec![quota("team-a", 4, 4, within())];
    let pods = [
        terminating(pod("team-a", "going", 0, Some(10), 2)),
        pod("team-a", "staying", 1, Some(10), 2),
    ];
    // What is going frees enough: wait.
    assert_eq!(
        decide(q(), &pods, "team-a", 9, 2),
        Ok(Preemption::Wait(vec![0]))
    );
    // Not enough: new victims for the rest only.
    assert_eq!(
        evicted(decide(q(), &pods, "team-a", 9, 4), &pods),
        ["staying"]
    );
    // A group with a member going is not chosen again.
    let group = [
        terminating(grouped(pod("team-a", "g-0", 0, Some(10), 1), "g")),
        grouped(pod("team-a", "g-1", 0, Some(10), 1), "g"),
        pod("team-a", "other", 1, Some(10), 2),
    ];
    assert_eq!(
        evicted(decide(q(), &group, "team-a", 9, 2), &group),
        ["other"]
    );
}

#[test]
fn a_terminating_pod_the_unit_could_not_evict_makes_no_room_for_it() {
    // "going" (priority 9) terminates for someone ahead; a unit of priority 9 could never
    // have had it evicted, so it does not wait on it but has the lower one evicted.
    let q = || vec![quota("team-a", 4, 4, within())];
    let pods = [
        terminating(pod("team-a", "going", 9, Some(10), 2)),
        pod("team-a", "low", 1, Some(10), 2),
    ];
    assert_eq!(evicted(decide(q(), &pods, "team-a", 9, 2), &pods), ["low"]);
    // A unit above it waits for it.
    assert_eq!(
        decide(q(), &pods, "team-a", 10, 2),
        Ok(Preemption::Wait(vec![0]))
    );
}

#[test]
fn a_candidate_is_read_from_its_pod() {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "w-0", "namespace": "team-a", "uid": "u1",
                     "labels": {pods::GROUP_LABEL: "train"},
                     "deletionTimestamp": "2025-01-01T00:00:10Z"},
        "spec": {"priority": 7, "containers": []},
        "status": {"startTime": "2025-01-01T00:00:00Z"}
    }))
    .unwrap();
    let c = Candidate::of(&pod, Charge::whole_gpus(1));
    assert_eq!(
        (c.namespace.as_str(), c.name.as_str(), c.uid.as_str()),
        ("team-a", "w-0", "u1")
    );
    assert_eq!(c.priority, 7);
    assert_eq!(
        c.started,
        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_735_689_600))
    );
    assert_eq!(c.group.as_deref(), Some("train"));
    assert!(c.terminating);
}
