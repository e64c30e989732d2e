//! Temporary raises: the spec in force at a time, what a check sees before and after an
//! expiry, the status and condition the controller keeps, and the Event told once.

use super::*;
use crate::quota::{escrow, note_raises, RaiseState, RAISE_CONDITION};
use k8s_openapi::jiff::Timestamp;

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

/// 4 GPUs and 40Gi, raised by 2 GPUs until noon and by 8 GPUs (of a dimension it limits) and
/// 10 `nvidia.com/gpu` (a dimension it does not) until 13:00.
fn raised_quota() -> GpuQuota {
    quota(
        "team-a",
        "default",
        json!({"hard": {"gpus": "4", "gpuMemory": "40Gi"}, "temporary": [
            {"hard": {"gpus": "2"}, "expires": "2026-12-10T12:00:00Z", "reason": "launch week (OPS-12)"},
            {"hard": {"gpus": "1/2", "devices": {"nvidia.com/gpu": 10}}, "expires": "2026-12-10T13:00:00Z", "reason": "demo"},
        ]}),
        json!({}),
    )
}

fn gpus_charge(g: &str) -> Charge {
    Charge {
        usage: Usage {
            gpus: gpus(g),
            ..Usage::default()
        },
        unknown: vec![],
    }
}

#[test]
fn the_spec_in_force_adds_each_raise_until_it_expires_and_only_where_hard_limits() {
    let q = raised_quota();
    let before = q.spec.in_force(at("2026-12-10T11:59:59Z"));
    assert_eq!(before.hard.gpus, Some(gpus("13/2")));
    assert_eq!(before.hard.gpu_memory, Some(Memory(40 * GI)));
    assert!(
        before.hard.devices.is_empty(),
        "an unlimited dimension stays unlimited"
    );
    assert!(before.temporary.is_empty());
    assert_eq!(
        before.in_force(at("2026-12-10T11:59:59Z")),
        before,
        "folding twice changes nothing"
    );
    // At the instant of expiry the raise no longer holds.
    let noon = q.spec.in_force(at("2026-12-10T12:00:00Z"));
    assert_eq!(noon.hard.gpus, Some(gpus("9/2")));
    assert_eq!(
        q.spec.in_force(at("2026-12-11T00:00:00Z")).hard,
        q.spec.hard
    );
    assert_eq!(
        q.spec.next_expiry(at("2026-12-10T11:00:00Z")),
        Some(at("2026-12-10T12:00:00Z"))
    );
    assert_eq!(
        q.spec.next_expiry(at("2026-12-10T12:00:00Z")),
        Some(at("2026-12-10T13:00:00Z"))
    );
    assert_eq!(q.spec.next_expiry(at("2026-12-10T13:00:00Z")), None);
}

#[test]
fn a_check_admits_into_a_raise_and_refuses_the_same_charge_once_it_expired() {
    let q = quota(
        "team-a",
        "default",
        json!({"hard": {"gpus": "4"}, "temporary": [
            {"hard": {"gpus": "2"}, "expires": "2026-12-10T12:00:00Z", "reason": "launch"}]}),
        json!({"used": {"gpus": "4"}}),
    );
    let two = gpus_charge("2");
    assert!(check(
        &q.clone().in_force(at("2026-12-10T11:59:00Z")),
        &[],
        None,
        &two
    )
    .is_ok());
    let d = check(
        &q.clone().in_force(at("2026-12-10T12:00:00Z")),
        &[],
        None,
        &two,
    )
    .unwrap_err();
    assert_eq!(
        d.to_string(),
        "gpus: requested 2, used 4 of 4 in GpuQuota team-a/default"
    );
    // A raise of a quota makes it decide every admission on the latest state: no escrow.
    assert!(!escrow::eligible(&q));
    assert!(escrow::eligible(
        &q.clone().in_force(at("2026-12-10T11:00:00Z"))
    ));
}

#[test]
fn the_controller_keeps_each_raise_state_and_tells_an_expiry_once() {
    let q = raised_quota();
    let mut s = GpuQuotaStatus::default();
    let told = note_raises(&q.spec, &mut s, at("2026-12-10T11:00:00Z"), Some(3));
    assert!(told.is_empty());
    let states: Vec<RaiseState> = s.temporary.iter().map(|r| r.state).collect();
    assert_eq!(states, [RaiseState::InForce, RaiseState::InForce]);
    let c = s
        .conditions
        .iter()
        .find(|c| c.type_ == RAISE_CONDITION)
        .unwrap();
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "InForce"));
    assert_eq!(
        c.message,
        "in force: gpus +2 until 2026-12-10T12:00:00Z (launch week (OPS-12)); gpus +1/2, \
         devices[nvidia.com/gpu] +10 until 2026-12-10T13:00:00Z (demo); hard now gpus 13/2, gpuMemory 40Gi"
    );
    assert_eq!(c.last_transition_time, "2026-12-10T11:00:00Z");

    let told = note_raises(&q.spec, &mut s, at("2026-12-10T12:00:05Z"), Some(3));
    assert_eq!(
        told,
        [
            "temporary raise gpus +2 (launch week (OPS-12)) expired at 2026-12-10T12:00:00Z: \
          new admissions see gpus 9/2, gpuMemory 40Gi"
        ]
    );
    assert!(
        note_raises(&q.spec, &mut s, at("2026-12-10T12:00:06Z"), Some(3)).is_empty(),
        "told once"
    );
    let c = s
        .conditions
        .iter()
        .find(|c| c.type_ == RAISE_CONDITION)
        .unwrap();
    assert_eq!(
        (c.status.as_str(), c.last_transition_time.as_str()),
        ("True", "2026-12-10T11:00:00Z")
    );

    let told = note_raises(&q.spec, &mut s, at("2026-12-10T14:00:00Z"), Some(3));
    assert_eq!(told.len(), 1);
    assert!(
        told[0]
            .starts_with("temporary raise gpus +1/2, devices[nvidia.com/gpu] +10 (demo) expired"),
        "{told:?}"
    );
    let c = s
        .conditions
        .iter()
        .find(|c| c.type_ == RAISE_CONDITION)
        .unwrap();
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Expired"));
    assert_eq!(
        c.message,
        "no raise in force; hard is spec.hard (gpus 4, gpuMemory 40Gi)"
    );
    assert_eq!(c.last_transition_time, "2026-12-10T14:00:00Z");

    // A raise already expired when first seen (created late, or the controller was down the
    // whole time) is not an Event: it never was in force for the controller.
    let mut fresh = GpuQuotaStatus::default();
    assert!(note_raises(&q.spec, &mut fresh, at("2026-12-11T00:00:00Z"), None).is_empty());

    // Raises removed from the spec: their state and the condition go.
    let mut plain = q.spec.clone();
    plain.temporary.clear();
    assert!(note_raises(&plain, &mut s, at("2026-12-11T00:00:00Z"), None).is_empty());
    assert!(s.temporary.is_empty());
    assert!(s.conditions.iter().all(|c| c.type_ != RAISE_CONDITION));
}

#[test]
fn a_raise_whose_expiry_is_not_a_time_is_never_in_force_and_says_what_to_fix() {
    let q = quota(
        "team-a",
        "default",
        json!({"hard": {"gpus": "4"}, "temporary": [
            {"hard": {"gpus": "2"}, "expires": "next friday", "reason": "launch"}]}),
        json!({}),
    );
    let now = at("2026-12-10T11:00:00Z");
    assert_eq!(q.spec.in_force(now).hard.gpus, Some(gpus("4")));
    let mut s = GpuQuotaStatus::default();
    assert!(note_raises(&q.spec, &mut s, now, None).is_empty());
    assert_eq!(s.temporary[0].state, RaiseState::Invalid);
    let c = &s.conditions[0];
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Invalid"));
    assert!(
        c.message.contains("raise (launch) is ignored: expires `next friday` is not an RFC 3339 time; fix it in spec.temporary"),
        "{}",
        c.message
    );
}
