//! The status's size bound: [`MAX_RESERVATIONS`], backpressure past it, and the room kept for
//! escrow flushes.

use super::*;
use crate::quota::escrow::MAX_UNFLUSHED;
use crate::quota::{note_raises, TemporaryRaise};

/// The most a status may take serialized (the issue's bound; etcd refuses ~1.5 MiB).
const BOUND: usize = 256 * 1024;

fn named(ns: &str, name: &str, state: ReservationState) -> Reservation {
    Reservation {
        namespace: ns.into(),
        state,
        ..reservation(name, &mem_charge(10))
    }
}

fn full_status(ns: &str) -> GpuQuotaStatus {
    let mut s = GpuQuotaStatus::default();
    for i in 0..MAX_RESERVATIONS {
        s.reservations
            .push(named(ns, &format!("p{i}"), ReservationState::Reserved));
    }
    s
}

/// Worst case: every entry at the longest legal names (a 63-character namespace, 253-character
/// object names), a 36-character uid, a charge in all three dimensions with two device
/// resources, the lowest priority; plus the escrows the room allows and a condition.
#[test]
fn a_full_status_with_the_longest_names_stays_under_256_kib() {
    let ns = "n".repeat(63);
    let charge = Usage {
        gpus: "1234567/7654321".parse().unwrap(),
        gpu_memory: Memory(1_000_000_000_000_001),
        devices: BTreeMap::from([
            ("nvidia.com/mig-3g.40gb".to_string(), u64::MAX),
            ("nvidia.com/gpu".to_string(), u64::MAX),
        ]),
    };
    let mut s = GpuQuotaStatus {
        used: charge.clone(),
        reserved: charge.clone(),
        queued: charge.clone(),
        ..GpuQuotaStatus::default()
    };
    for i in 0..MAX_RESERVATIONS {
        let name = format!("{i:0>253}");
        s.reservations.push(Reservation {
            kind: ObjectKind::ResourceClaim,
            namespace: ns.clone(),
            uid: Some("0".repeat(36)),
            charge: charge.clone(),
            priority: Some(i32::MIN),
            since: "2026-12-31T23:59:59Z".into(),
            ..named(&ns, &name, ReservationState::Queued)
        });
    }
    for i in 0..MAX_RESERVATIONS / MAX_UNFLUSHED {
        s.escrows.push(Escrow {
            holder: format!("{i:0>253}"),
            amount: charge.clone(),
            renewed: "2026-12-31T23:59:59Z".into(),
        });
    }
    s.conditions.push(QuotaCondition {
        type_: "QueueWaiting".into(),
        status: "True".into(),
        reason: "PodsWaiting".into(),
        message: "m".repeat(1024),
        last_transition_time: "2026-12-31T23:59:59Z".into(),
        observed_generation: Some(i64::MAX),
    });
    // And the most raises the CRD allows, each at its longest, in force.
    let devices: BTreeMap<String, u64> = (0..64).map(|i| (format!("{i:0>63}"), u64::MAX)).collect();
    let raise = TemporaryRaise {
        hard: Limits {
            gpus: Some(charge.gpus),
            gpu_memory: Some(charge.gpu_memory),
            devices,
        },
        expires: "2026-12-31T23:59:59.999999999+14:00".into(),
        reason: "r".repeat(256),
    };
    let spec = GpuQuotaSpec {
        temporary: vec![raise; 16],
        ..GpuQuotaSpec::default()
    };
    let now: k8s_openapi::jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
    note_raises(&spec, &mut s, now, Some(i64::MAX));
    let bytes = serde_json::to_vec(&s).unwrap().len();
    println!("worst-case status: {bytes} bytes at {MAX_RESERVATIONS} reservations");
    assert!(bytes < BOUND, "{bytes} bytes");
}

#[test]
fn past_the_cap_an_admission_is_refused_as_retryable_backpressure() {
    let mut q = quota(
        "team-a",
        "q",
        json!({"hard": {"gpuMemory": "100000Gi"}}),
        json!({}),
    );
    let mut s = full_status("team-a");
    s.recompute_totals().unwrap();
    q.status = Some(s);
    let ops = [
        reserve_op("new", &mem_charge(10)),
        // Its own entry is already there: re-deciding it needs no room.
        reserve_op("p7", &mem_charge(10)),
        Op::Queue {
            reservation: named("team-a", "gated", ReservationState::Queued),
        },
    ];
    let d = decide_batch(&mut q, &[], &ops, None);
    let Outcome::Backpressure(why) = &d.outcomes[0] else {
        panic!("{:?}", d.outcomes)
    };
    assert!(
        why.contains("GpuQuota team-a/q") && why.contains("try again"),
        "{why}"
    );
    assert!(
        matches!(d.outcomes[1], Outcome::Fits(_)),
        "{:?}",
        d.outcomes
    );
    // The gate holds the pod: queued, not recorded.
    assert_eq!(d.outcomes[2], Outcome::Queued);
    let s = q.status.clone().unwrap();
    assert_eq!(s.reservations.len(), MAX_RESERVATIONS);
    assert!(s
        .reservation(&ReservationKey::pod("team-a", "gated"))
        .is_none());

    // Once the controller drops an observed entry, the admission goes through.
    let mut s = s;
    s.release(&ReservationKey::pod("team-a", "p0")).unwrap();
    q.status = Some(s);
    let d = decide_batch(&mut q, &[], &[reserve_op("new", &mem_charge(10))], None);
    assert!(
        matches!(d.outcomes[0], Outcome::Fits(_)),
        "{:?}",
        d.outcomes
    );
    assert_eq!(q.status.unwrap().room(), 0);
}

#[test]
fn an_escrow_is_granted_only_with_room_for_its_flush() {
    let spec = json!({"hard": {"gpuMemory": "100000Gi"}});
    let ten = mem_charge(10);
    let mut q = quota("team-a", "q", spec, json!({}));
    let mut s = full_status("team-a");
    s.reservations.truncate(MAX_RESERVATIONS - MAX_UNFLUSHED);
    q.status = Some(s);
    // Exactly the room for one flush: granted, and it keeps that room from other admissions.
    let d = decide_batch(&mut q, &[], &[], Some(&escrow_round("a", &[], Some(&ten))));
    assert!(!d.escrow.is_zero());
    assert_eq!(q.status.clone().unwrap().room(), 0);
    let d = decide_batch(&mut q, &[], &[reserve_op("x", &ten)], None);
    assert!(matches!(d.outcomes[0], Outcome::Backpressure(_)));
    // Its flush always fits; a second holder gets no escrow.
    let flush: Vec<String> = (0..MAX_UNFLUSHED).map(|i| format!("e{i}")).collect();
    let flush: Vec<&str> = flush.iter().map(String::as_str).collect();
    let d = decide_batch(
        &mut q,
        &[],
        &[],
        Some(&escrow_round("a", &flush, Some(&ten))),
    );
    assert!(d.changed && d.escrow.is_zero());
    let d = decide_batch(&mut q, &[], &[], Some(&escrow_round("b", &[], Some(&ten))));
    assert!(d.escrow.is_zero());
    let s = q.status.unwrap();
    assert_eq!(s.reservations.len(), MAX_RESERVATIONS);
    assert!(s.escrows.is_empty());
}
