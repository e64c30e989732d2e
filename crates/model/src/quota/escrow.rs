//! Escrow, the pure part: a webhook replica holds a share of a GpuQuota's headroom in the
//! status ([`Escrow`]) and admits within it without writing the status per admission.
//!
//! Exactness: an escrow counts against `hard` like usage ([`GpuQuotaStatus::consumed`]), and it
//! only grows in a status write made on the latest state (resourceVersion), after checking that
//! everything counted still fits. The holder admits only while `spent + charge <= amount`, and
//! later records those admissions as reservations in the same write that takes their charge
//! out of the escrow ([`super::decide_batch`] with an [`EscrowRound`]). So every admitted object
//! is always covered by its pod in `used`, by a reservation, or by its holder's escrow, and
//! their sum never exceeds `hard`. A holder that dies leaves its escrow in place: whatever it
//! admitted shows up as pods within the API server's request timeout, and the controller drops
//! the escrow once it has not been renewed for the reservation grace ([`stale_escrows`]); the
//! holder stops spending long before that ([`SPEND_WINDOW`]).
//!
//! Liveness: escrows are small (a quarter of the headroom, in whole multiples of the latest
//! charge, so a quota with room for fewer than four such admissions gets none), given back
//! when their holder is idle, and an admission that would fit but for another replica's
//! escrow is not denied at once but decided again ([`super::Outcome::Held`]).

pub mod replica;

use super::clock::{age, rfc3339};
use super::crd::{Escrow, GpuQuota, GpuQuotaStatus, QuotaMode};
use super::ratio::QuotaMathError;
use super::usage::{Limits, Usage};
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

/// A holder spends its escrow only this long after its last successful write of it; far
/// under the grace after which the controller may drop it, so that what it admitted has
/// become pods by then (the API server's request timeout is one minute).
pub const SPEND_WINDOW: Duration = Duration::from_secs(30);

/// An escrow is rewritten (renewed) at the latest this long after its last write.
pub const RENEW_AFTER: Duration = Duration::from_secs(10);

/// The most admissions (of the latest charge) one escrow covers.
pub const MAX_GRANT: u64 = 256;

/// The most admissions a holder makes within its escrow between two writes of it: each escrow
/// keeps this much room in the status's reservation list ([`GpuQuotaStatus::room`]) for its
/// flush, and one is granted only where that room is free, so a flush always fits under
/// [`super::status::MAX_RESERVATIONS`].
pub const MAX_UNFLUSHED: usize = 64;

/// An escrow takes at most 1/SHARE of the headroom, so other replicas and the controller keep
/// most of it.
pub const SHARE: u64 = 4;

/// Escrow applies to Reject-mode quotas without a cohort: Queue mode admits through the
/// controller, and borrowing must read the lenders at each admission. Not to quotas with
/// temporary raises either: an escrow granted under a raise could still be spent after it
/// expired, and an expiry must hold for the next admission.
pub fn eligible(quota: &GpuQuota) -> bool {
    quota.spec.mode == QuotaMode::Reject
        && quota.spec.cohort.is_none()
        && quota.spec.temporary.is_empty()
        && !quota.spec.hard.is_empty()
}

/// `u` in the dimensions `hard` limits only (an unlimited dimension needs no escrow).
pub fn limited(hard: &Limits, u: &Usage) -> Usage {
    Usage {
        gpus: if hard.gpus.is_some() {
            u.gpus
        } else {
            Default::default()
        },
        gpu_memory: if hard.gpu_memory.is_some() {
            u.gpu_memory
        } else {
            Default::default()
        },
        devices: u
            .devices
            .iter()
            .filter(|(k, v)| **v != 0 && hard.devices.contains_key(*k))
            .map(|(k, v)| (k.clone(), *v))
            .collect(),
    }
}

/// Whether `charge` is known in every dimension `hard` limits (what it could not price does
/// not matter where nothing is limited; where something is, the batch decides and says why).
pub fn priced(hard: &Limits, charge: &super::usage::Charge) -> bool {
    charge
        .unknown
        .iter()
        .all(|u| hard.get(&u.dimension).is_none())
}

/// Whether `charge` fits in `available` (an escrow's amount minus what was spent of it) in
/// every dimension `hard` limits.
pub fn fits(hard: &Limits, available: &Usage, charge: &Usage) -> bool {
    hard.bounds().iter().all(|(dim, _)| {
        let c = charge.get(dim);
        c.is_zero() || c <= available.get(dim)
    })
}

/// The escrow to hold next, given what counts against `hard` without it (`consumed`) and the
/// latest admission's charge (`unit`): the largest `k * unit` (`k <= MAX_GRANT`) such that
/// `SHARE * k * unit` fits the headroom in every limited dimension; zero when not even one.
pub fn grant(hard: &Limits, consumed: &Usage, unit: &Usage) -> Result<Usage, QuotaMathError> {
    let unit = limited(hard, unit);
    if unit.is_zero() {
        return Ok(Usage::default());
    }
    let fits_k = |k: u64| -> Result<bool, QuotaMathError> {
        let need = consumed.checked_add(&unit.checked_mul_int(k.saturating_mul(SHARE))?)?;
        Ok(hard
            .bounds()
            .iter()
            .all(|(dim, bound)| need.get(dim) <= *bound))
    };
    // Binary search for the largest k in 0..=MAX_GRANT that fits (fitting is monotone in k).
    let (mut lo, mut hi) = (0u64, MAX_GRANT);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits_k(mid)? {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    unit.checked_mul_int(lo)
}

/// One holder's part in a batch: the admissions it made within its escrow since its last
/// write (recorded as reservations now, their charge leaving the escrow) and how to size the
/// escrow it keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct EscrowRound {
    pub holder: String,
    pub flush: Vec<super::crd::Reservation>,
    /// Size the next escrow by this charge; `None`: hold none (give it back).
    pub unit: Option<Usage>,
    pub now: Timestamp,
}

/// Sum of the escrows of holders other than `holder`.
pub fn held_by_others(status: &GpuQuotaStatus, holder: &str) -> Result<Usage, QuotaMathError> {
    Usage::sum(
        status
            .escrows
            .iter()
            .filter(|e| e.holder != holder)
            .map(|e| &e.amount),
    )
}

/// Holders whose escrow was not renewed for `grace` (or whose time does not parse).
pub fn stale_escrows(status: &GpuQuotaStatus, now: Timestamp, grace: Duration) -> Vec<String> {
    status
        .escrows
        .iter()
        .filter(|e| match e.renewed.parse::<Timestamp>() {
            Ok(t) => age(t, now).is_some_and(|a| a >= grace),
            Err(_) => true,
        })
        .map(|e| e.holder.clone())
        .collect()
}

/// The escrow entry to write for `amount` held now by `holder`, keeping the old renewal time
/// when nothing changed and it is recent (a batch that changes nothing else writes nothing).
pub fn entry(old: Option<&Escrow>, holder: &str, amount: Usage, now: Timestamp) -> Option<Escrow> {
    if amount.is_zero() {
        return None;
    }
    if let Some(o) = old {
        let recent = o
            .renewed
            .parse::<Timestamp>()
            .is_ok_and(|t| age(t, now).is_some_and(|a| a < RENEW_AFTER));
        if o.amount == amount && recent {
            return Some(o.clone());
        }
    }
    Some(Escrow {
        holder: holder.into(),
        amount,
        renewed: rfc3339(now),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn devices(n: u64) -> Usage {
        Usage {
            devices: BTreeMap::from([("nvidia.com/gpu".to_string(), n)]),
            ..Usage::default()
        }
    }

    fn hard(n: u64) -> Limits {
        Limits {
            devices: BTreeMap::from([("nvidia.com/gpu".to_string(), n)]),
            ..Limits::default()
        }
    }

    #[test]
    fn a_grant_is_a_quarter_of_the_headroom_in_whole_charges_and_none_when_small() {
        assert_eq!(
            grant(&hard(37), &devices(1), &devices(1)).unwrap(),
            devices(9)
        );
        assert_eq!(
            grant(&hard(37), &devices(30), &devices(1)).unwrap(),
            devices(1)
        );
        // Room for three more: no escrow, every admission is written.
        assert!(grant(&hard(37), &devices(34), &devices(1))
            .unwrap()
            .is_zero());
        assert!(grant(&hard(2), &devices(1), &devices(1)).unwrap().is_zero());
        // Over-full (a double count while pods settle): nothing.
        assert!(grant(&hard(2), &devices(5), &devices(1)).unwrap().is_zero());
        assert_eq!(
            grant(&hard(100_000), &Usage::default(), &devices(1)).unwrap(),
            devices(MAX_GRANT)
        );
        assert_eq!(
            grant(&hard(400), &devices(0), &devices(8)).unwrap(),
            devices(96)
        );
    }

    #[test]
    fn unlimited_dimensions_are_neither_held_nor_checked() {
        let mut charge = devices(1);
        charge.gpus = "1".parse().unwrap();
        let g = grant(&hard(40), &Usage::default(), &charge).unwrap();
        assert_eq!(g, devices(10), "gpus is not limited, so not held");
        assert!(fits(&hard(40), &devices(1), &charge));
        assert!(!fits(&hard(40), &devices(0), &charge));
        let mut other = Usage::default();
        other.devices.insert("nvidia.com/mig-1g.10gb".into(), 3);
        assert!(fits(&hard(40), &Usage::default(), &other));
    }

    #[test]
    fn stale_escrows_are_those_not_renewed_within_the_grace() {
        let now: Timestamp = "2026-01-01T00:10:00Z".parse().unwrap();
        let mut s = GpuQuotaStatus::default();
        for (h, t) in [
            ("fresh", "2026-01-01T00:09:00Z"),
            ("old", "2026-01-01T00:07:59Z"),
            ("garbled", "yesterday"),
        ] {
            s.escrows.push(Escrow {
                holder: h.into(),
                amount: devices(1),
                renewed: t.into(),
            });
        }
        assert_eq!(
            stale_escrows(&s, now, Duration::from_secs(120)),
            vec!["old".to_string(), "garbled".to_string()]
        );
        assert_eq!(held_by_others(&s, "fresh").unwrap(), devices(2));
    }

    #[test]
    fn an_unchanged_recent_entry_keeps_its_time_and_a_zero_one_is_removed() {
        let now: Timestamp = "2026-01-01T00:10:00Z".parse().unwrap();
        let old = Escrow {
            holder: "a".into(),
            amount: devices(2),
            renewed: "2026-01-01T00:09:55Z".into(),
        };
        assert_eq!(entry(Some(&old), "a", devices(2), now), Some(old.clone()));
        let renewed = entry(Some(&old), "a", devices(3), now).unwrap();
        assert_eq!(renewed.renewed, "2026-01-01T00:10:00Z");
        let older = Escrow {
            renewed: "2026-01-01T00:09:40Z".into(),
            ..old
        };
        assert_eq!(
            entry(Some(&older), "a", devices(2), now).unwrap().renewed,
            "2026-01-01T00:10:00Z"
        );
        assert_eq!(entry(Some(&older), "a", Usage::default(), now), None);
    }
}
