//! Does a charge fit a quota? (pure)
//!
//! Per dimension the quota limits and the charge touches: `used + reserved + charge <= hard`.
//! A dimension the charge does not touch is not checked (an over-full quota still admits pods
//! that do not use what is over), as Kubernetes' ResourceQuota does. A dimension whose charge
//! is unknown is denied. With a cohort, what exceeds `hard` may be borrowed: up to
//! `borrowingLimit`, and only while the whole cohort stays within the sum of its members'
//! `hard` (quotas that do not limit the dimension neither lend nor count).

use super::crd::GpuQuota;
use super::ratio::QuotaMathError;
use super::status::ReservationKey;
use super::usage::Charge;
use super::usage::{Amount, Dimension};
use std::fmt;

/// A charge fits; `borrowed` lists what it takes from the cohort, per dimension.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fit {
    pub borrowed: Vec<(Dimension, Amount)>,
}

/// Why a charge does not fit, in words a user can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// `namespace/name` of the quota.
    pub quota: String,
    /// One line per dimension that does not fit, e.g.
    /// `gpuMemory: requested 10Gi, used 15Gi of 20Gi in GpuQuota team-a/default`.
    pub reasons: Vec<String>,
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reasons.join("; "))
    }
}

impl std::error::Error for Denial {}

/// Whether `charge` fits `quota` (whose status is as read), given the other quotas of the
/// cluster (`peers`; those of other cohorts and `quota` itself are ignored). `key`: the
/// object being admitted, whose own earlier reservation is not counted.
pub fn check(
    quota: &GpuQuota,
    peers: &[GpuQuota],
    key: Option<&ReservationKey>,
    charge: &Charge,
) -> Result<Fit, Denial> {
    let consumed = match &quota.status {
        Some(s) => s.consumed(key),
        None => Ok(super::usage::Usage::default()),
    }
    .map_err(|e| Denial {
        quota: quota.id(),
        reasons: vec![format!("{e} while checking GpuQuota {}", quota.id())],
    })?;
    check_consumed(quota, &consumed, peers, charge)
}

/// [`check`] with what counts against `hard` already summed (`consumed`: `used` plus the
/// `Reserved` reservations, the admitted object's own excluded); `quota`'s status is not read.
/// The batch decision keeps that sum as it goes instead of re-adding every reservation.
pub fn check_consumed(
    quota: &GpuQuota,
    consumed: &super::usage::Usage,
    peers: &[GpuQuota],
    charge: &Charge,
) -> Result<Fit, Denial> {
    let id = quota.id();
    let deny = |reasons: Vec<String>| Denial {
        quota: id.clone(),
        reasons,
    };
    let overflow = |e: QuotaMathError| deny(vec![format!("{e} while checking GpuQuota {id}")]);
    let cohort: Vec<&GpuQuota> = match &quota.spec.cohort {
        Some(c) => peers
            .iter()
            .filter(|p| p.spec.cohort.as_deref() == Some(c.as_str()) && p.id() != id)
            .collect(),
        None => Vec::new(),
    };
    let mut fit = Fit::default();
    let mut reasons = Vec::new();
    for (dim, hard) in quota.spec.hard.bounds() {
        let req = charge.usage.get(&dim);
        if let Some(u) = charge.unknown_in(&dim) {
            reasons.push(format!(
                "{dim}: cannot be charged ({}), and GpuQuota {id} limits it",
                u.why
            ));
            continue;
        }
        if req.is_zero() {
            continue;
        }
        let used = consumed.get(&dim);
        let need = used.checked_add(req).map_err(overflow)?;
        if need <= hard {
            continue;
        }
        let base = format!("{dim}: requested {req}, used {used} of {hard} in GpuQuota {id}");
        let Some(cohort_name) = &quota.spec.cohort else {
            reasons.push(base);
            continue;
        };
        let borrow = need.saturating_sub(hard).map_err(overflow)?;
        if let Some(limit) = quota
            .spec
            .borrowing_limit
            .as_ref()
            .and_then(|l| l.get(&dim))
        {
            if borrow > limit {
                reasons.push(format!(
                    "{base}; borrowing {borrow} from cohort {cohort_name} exceeds its borrowing limit {limit}"
                ));
                continue;
            }
        }
        let unused = cohort_unused(&cohort, &dim, hard).map_err(overflow)?;
        if borrow > unused {
            reasons.push(format!(
                "{base}; cohort {cohort_name} has {unused} unused to lend, {borrow} needed"
            ));
            continue;
        }
        fit.borrowed.push((dim, borrow));
    }
    if reasons.is_empty() {
        Ok(fit)
    } else {
        Err(deny(reasons))
    }
}

/// What the rest of the cohort leaves unused of `dim`: the sum of their hard minus the sum of
/// their consumption (their own borrowing included).
fn cohort_unused(
    cohort: &[&GpuQuota],
    dim: &Dimension,
    hard: Amount,
) -> Result<Amount, QuotaMathError> {
    let mut lend_hard = zero_like(hard);
    let mut lend_used = zero_like(hard);
    for p in cohort {
        let Some(h) = p.spec.hard.get(dim) else {
            continue;
        };
        let c = match &p.status {
            Some(s) => s.consumed(None)?.get(dim),
            None => zero_like(hard),
        };
        lend_hard = lend_hard.checked_add(h)?;
        lend_used = lend_used.checked_add(c)?;
    }
    lend_hard.saturating_sub(lend_used)
}

/// What `quota` (its status as read) takes from its cohort: in each dimension its `hard`
/// limits, what it consumes beyond `hard`; only the dimensions where that is more than zero.
pub fn borrowing(quota: &GpuQuota) -> Result<Vec<(Dimension, Amount)>, QuotaMathError> {
    let Some(status) = &quota.status else {
        return Ok(Vec::new());
    };
    let consumed = status.consumed(None)?;
    let mut out = Vec::new();
    for (dim, hard) in quota.spec.hard.bounds() {
        let over = consumed.get(&dim).saturating_sub(hard)?;
        if !over.is_zero() {
            out.push((dim, over));
        }
    }
    Ok(out)
}

fn zero_like(a: Amount) -> Amount {
    match a {
        Amount::Gpus(_) => Amount::Gpus(super::ratio::Gpus::ZERO),
        Amount::Memory(_) => Amount::Memory(super::usage::Memory::ZERO),
        Amount::Count(_) => Amount::Count(0),
    }
}

/// Checks `charge` against `quota` and, when it fits, records `reservation` (state
/// `Reserved`, replacing one with the same key) in its status. Returns the fit and whether
/// the status changed (an identical reservation already there needs no write).
pub fn try_reserve(
    quota: &mut GpuQuota,
    peers: &[GpuQuota],
    mut reservation: super::crd::Reservation,
    charge: &Charge,
) -> Result<(Fit, bool), Denial> {
    let key = reservation.key();
    let fit = check(quota, peers, Some(&key), charge)?;
    reservation.state = super::crd::ReservationState::Reserved;
    reservation.charge = charge.usage.clone();
    let mut status = quota.status_or_default();
    if let Some(old) = status.reservation(&key) {
        if old.state == reservation.state
            && old.charge == reservation.charge
            && old.uid == reservation.uid
        {
            return Ok((fit, false));
        }
    }
    status.upsert(reservation).map_err(|e| Denial {
        quota: quota.id(),
        reasons: vec![format!(
            "{e} while recording a reservation in GpuQuota {}",
            quota.id()
        )],
    })?;
    quota.status = Some(status);
    Ok((fit, true))
}

/// Records `reservation` as `Queued` in `quota`'s status (no check). Returns whether the
/// status changed.
pub fn record_queued(
    quota: &mut GpuQuota,
    mut reservation: super::crd::Reservation,
) -> Result<bool, QuotaMathError> {
    reservation.state = super::crd::ReservationState::Queued;
    let mut status = quota.status_or_default();
    if let Some(old) = status.reservation(&reservation.key()) {
        if old.state == reservation.state
            && old.charge == reservation.charge
            && old.uid == reservation.uid
        {
            return Ok(false);
        }
    }
    status.upsert(reservation)?;
    quota.status = Some(status);
    Ok(true)
}
