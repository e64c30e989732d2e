//! Group commit, the pure part: every admission waiting for one GpuQuota decided in arrival
//! order on one state, so that one status write records them all.
//!
//! [`decide_batch`] applies a list of [`Op`]s to a quota as read, each seeing the ones before
//! it (a reservation admitted earlier in the batch counts against the next), and says per op
//! what happened and whether the status changed. The caller writes the status once with the
//! resourceVersion it read and answers only after that write succeeded; a conflict means:
//! read again and decide the whole batch again. Nothing here is admitted until written.
//!
//! With an [`EscrowRound`] the batch also records the admissions its replica made within its
//! escrow (as reservations, their charge leaving the escrow) and sizes the escrow it keeps
//! (see [`super::escrow`]); the replica's own escrow is not counted against the batch's ops.
//!
//! Cohort borrowing reads the lenders' state, which the borrower's write does not guard.
//! [`stale_borrowers`] closes that gap: after the borrower's write, the lenders (every other
//! quota of the cohort) are read again and each borrowing admission is checked once more
//! against them. Of two borrowers racing, each writes its reservation before it reads the
//! other, so at least one of them sees the other's reservation; an admission is answered only
//! when it still fits against a read made after its own reservation was durable, hence the
//! admitted borrowers never take together more than the cohort had unused.

use super::check::{check_consumed, Denial, Fit};
use super::crd::{Escrow, GpuQuota, GpuQuotaStatus, Reservation, ReservationState};
use super::escrow::{self, EscrowRound};
use super::status::{ReservationKey, MAX_RESERVATIONS};
use super::usage::Charge;
use super::usage::Usage;
use std::collections::HashMap;

/// One request waiting for a quota.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Check `charge` and record `reservation` as `Reserved` when it fits. `retreat`: this
    /// request's own reservation may already be in the status from an earlier attempt whose
    /// borrowing did not hold up; on a denial it is removed.
    Reserve {
        reservation: Reservation,
        charge: Charge,
        retreat: bool,
    },
    /// A `dryRun` request: check, record nothing.
    Check { key: ReservationKey, charge: Charge },
    /// Record `reservation` as `Queued` (Queue mode: gated, not counted).
    Queue { reservation: Reservation },
    /// Remove the reservation with this key (a request denied by another quota of its
    /// namespace gives back what it took here).
    Release { key: ReservationKey },
}

impl Op {
    pub fn key(&self) -> ReservationKey {
        match self {
            Op::Reserve { reservation, .. } | Op::Queue { reservation } => reservation.key(),
            Op::Check { key, .. } | Op::Release { key } => key.clone(),
        }
    }
}

/// What happened to one [`Op`].
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// It fits (recorded for `Reserve`, only checked for `Check`).
    Fits(Fit),
    Denied(Denial),
    /// Does not fit now, but would without other replicas' escrows: decide it again shortly
    /// (they are given back when idle or spent); the denial is the answer when time is up.
    Held(Denial),
    /// Recorded as queued, or, with no room left in the status, not recorded (the scheduling
    /// gate holds the pod; the controller's queue sees it in its pod cache).
    Queued,
    Released,
    /// Refused before checking: the status holds [`MAX_RESERVATIONS`] entries (admitted
    /// objects the controller has not seen yet); retryable, the message says why.
    Backpressure(String),
    /// The arithmetic overflowed; nothing was recorded for this op.
    Failed(String),
}

/// The decisions of one batch, in the order of the ops.
#[derive(Debug, Clone, PartialEq)]
pub struct Decided {
    pub outcomes: Vec<Outcome>,
    /// The status differs from what was read: it must be written before anyone is answered.
    pub changed: bool,
    /// What the round's holder holds in escrow in the decided status (zero: none).
    pub escrow: Usage,
}

/// Why an admission is refused while `quota`'s status is full.
pub fn backpressure(quota: &str) -> String {
    format!(
        "GpuQuota {quota} holds {MAX_RESERVATIONS} reservations of admitted pods and claims the \
         quota controller has not counted yet (the most its status keeps); try again once it \
         has caught up"
    )
}

fn unchanged(old: &Reservation, new: &Reservation) -> bool {
    old.state == new.state && old.charge == new.charge && old.uid == new.uid
}

/// Decides `ops` in order on `quota` (as read), recording what fits in its status. `peers`:
/// the cohort's other quotas (see [`super::check::check`]); `round`: the deciding replica's
/// escrow work, if it holds or wants one. Totals are recomputed once at the end.
pub fn decide_batch(
    quota: &mut GpuQuota,
    peers: &[GpuQuota],
    ops: &[Op],
    round: Option<&EscrowRound>,
) -> Decided {
    let mut status = quota.status.take().unwrap_or_default();
    let id = quota.id();
    // The holder's own escrow comes out (re-sized at the end); what it admitted within it
    // becomes reservations.
    let (own_escrow, flushed) = match round {
        Some(r) => take_escrow(&mut status, r),
        None => (None, false),
    };
    let holder = round.map(|r| r.holder.as_str()).unwrap_or("");
    let start = escrow::held_by_others(&status, holder)
        .and_then(|others| Ok((others, status.consumed(None)?)));
    let (others, total) = match start {
        Ok(t) => t,
        Err(e) => {
            let why = format!("{e} while checking GpuQuota {id}");
            quota.status = Some(status);
            return Decided {
                outcomes: ops.iter().map(|_| Outcome::Failed(why.clone())).collect(),
                changed: false,
                escrow: Usage::default(),
            };
        }
    };
    let mut b = Batch {
        quota,
        peers,
        id: &id,
        index: index_of(&status.reservations),
        status,
        total,
        others,
        changed: flushed,
    };
    let mut outcomes: Vec<Outcome> = ops.iter().map(|op| b.decide(op)).collect();
    let Batch {
        mut status,
        total,
        mut changed,
        ..
    } = b;
    let mut held = Usage::default();
    if let Some(r) = round {
        let amount = match &r.unit {
            // An escrow keeps room for its flush in the reservation list (see `room`).
            Some(unit) if escrow::eligible(quota) && status.room() >= escrow::MAX_UNFLUSHED => {
                escrow::grant(&quota.spec.hard, &total, unit).unwrap_or_default()
            }
            _ => Usage::default(),
        };
        let new = escrow::entry(own_escrow.as_ref(), &r.holder, amount, r.now);
        if new != own_escrow {
            changed = true;
        }
        if let Some(e) = new {
            held = e.amount.clone();
            status.escrows.push(e);
        }
    }
    if changed {
        if let Err(e) = status.recompute_totals() {
            // Cannot happen when every addition above succeeded; refuse the whole batch.
            let why = format!("{e} while recording reservations in GpuQuota {id}");
            outcomes = ops.iter().map(|_| Outcome::Failed(why.clone())).collect();
            changed = false;
        }
    }
    quota.status = Some(status);
    Decided {
        outcomes,
        changed,
        escrow: held,
    }
}

/// Takes `round`'s holder's escrow out of `status` and records what it admitted within it as
/// reservations. Returns the escrow taken and whether a reservation changed.
fn take_escrow(status: &mut GpuQuotaStatus, round: &EscrowRound) -> (Option<Escrow>, bool) {
    let own = status
        .escrows
        .iter()
        .position(|e| e.holder == round.holder)
        .map(|i| status.escrows.remove(i));
    let mut changed = false;
    for f in &round.flush {
        let mut f = f.clone();
        f.state = ReservationState::Reserved;
        match status.reservations.iter_mut().find(|x| x.key() == f.key()) {
            Some(x) if unchanged(x, &f) => {}
            Some(x) => {
                *x = f;
                changed = true;
            }
            None => {
                status.reservations.push(f);
                changed = true;
            }
        }
    }
    (own, changed)
}

fn index_of(list: &[Reservation]) -> HashMap<ReservationKey, usize> {
    list.iter().enumerate().map(|(i, r)| (r.key(), i)).collect()
}

/// One batch being decided: the status as it stands after the ops so far, and what counts
/// against `hard` (`total`: `used`, the escrows and every Reserved reservation).
struct Batch<'a> {
    quota: &'a GpuQuota,
    peers: &'a [GpuQuota],
    id: &'a str,
    status: GpuQuotaStatus,
    index: HashMap<ReservationKey, usize>,
    total: Usage,
    /// Escrows of the other replicas (a denial they alone cause is [`Outcome::Held`]).
    others: Usage,
    changed: bool,
}

impl Batch<'_> {
    fn decide(&mut self, op: &Op) -> Outcome {
        let key = op.key();
        // An object being re-decided is not counted twice.
        let own = self.index.get(&key).and_then(|&i| {
            let r = &self.status.reservations[i];
            (r.state == ReservationState::Reserved).then(|| r.charge.clone())
        });
        let without_own = match &own {
            Some(c) => self.total.saturating_sub(c),
            None => Ok(self.total.clone()),
        };
        let without_own = match without_own {
            Ok(u) => u,
            Err(e) => return Outcome::Failed(format!("{e} while checking GpuQuota {}", self.id)),
        };
        match op {
            Op::Check { charge, .. } => {
                match check_consumed(self.quota, &without_own, self.peers, charge) {
                    Ok(fit) => Outcome::Fits(fit),
                    Err(d) => Outcome::Denied(d),
                }
            }
            Op::Reserve { .. } if !self.index.contains_key(&key) && self.status.room() == 0 => {
                Outcome::Backpressure(backpressure(self.id))
            }
            Op::Reserve {
                reservation,
                charge,
                retreat,
            } => self.reserve(key, reservation, charge, *retreat, without_own),
            // No room: not recorded, the gate holds the pod.
            Op::Queue { .. } if !self.index.contains_key(&key) && self.status.room() == 0 => {
                Outcome::Queued
            }
            Op::Queue { reservation } => {
                let mut r = reservation.clone();
                r.state = ReservationState::Queued;
                if self.upsert(key, r) && own.is_some() {
                    self.total = without_own;
                }
                Outcome::Queued
            }
            Op::Release { .. } => {
                if self.remove(&key) {
                    self.total = without_own;
                }
                Outcome::Released
            }
        }
    }

    fn reserve(
        &mut self,
        key: ReservationKey,
        reservation: &Reservation,
        charge: &Charge,
        retreat: bool,
        without_own: Usage,
    ) -> Outcome {
        match check_consumed(self.quota, &without_own, self.peers, charge) {
            Ok(fit) => {
                let mut r = reservation.clone();
                r.state = ReservationState::Reserved;
                r.charge = charge.usage.clone();
                match without_own.checked_add(&r.charge) {
                    Ok(t) => {
                        self.upsert(key, r);
                        self.total = t;
                        Outcome::Fits(fit)
                    }
                    Err(e) => Outcome::Failed(format!(
                        "{e} while recording a reservation in GpuQuota {}",
                        self.id
                    )),
                }
            }
            Err(d) => {
                let held = !self.others.is_zero()
                    && without_own.saturating_sub(&self.others).is_ok_and(|free| {
                        check_consumed(self.quota, &free, self.peers, charge).is_ok()
                    });
                if retreat && self.remove(&key) {
                    self.total = without_own;
                }
                if held {
                    Outcome::Held(d)
                } else {
                    Outcome::Denied(d)
                }
            }
        }
    }

    /// Records `r` under `key`; whether the status changed.
    fn upsert(&mut self, key: ReservationKey, r: Reservation) -> bool {
        match self.index.get(&key) {
            Some(&i) if unchanged(&self.status.reservations[i], &r) => return false,
            Some(&i) => self.status.reservations[i] = r,
            None => {
                self.index.insert(key, self.status.reservations.len());
                self.status.reservations.push(r);
            }
        }
        self.changed = true;
        true
    }

    /// Removes the reservation under `key`; whether there was one.
    fn remove(&mut self, key: &ReservationKey) -> bool {
        let Some(i) = self.index.remove(key) else {
            return false;
        };
        self.status.reservations.remove(i);
        for v in self.index.values_mut() {
            if *v > i {
                *v -= 1;
            }
        }
        self.changed = true;
        true
    }
}

/// After a batch was written: the borrowing admissions (`Reserve` ops whose outcome borrowed
/// from the cohort) that no longer fit against `fresh_peers`, the cohort's other quotas read
/// after the write, with the reason. `written` is the quota as written.
///
/// Each borrower is checked in batch order: against everything written except itself and the
/// borrowers after it (which are checked with it included), so a batch keeps the longest
/// prefix of borrowers that fits, and what is admitted fits as a whole.
pub fn stale_borrowers(
    written: &GpuQuota,
    fresh_peers: &[GpuQuota],
    ops: &[Op],
    outcomes: &[Outcome],
) -> Vec<(usize, Denial)> {
    let id = written.id();
    let fail = |e: super::ratio::QuotaMathError| Denial {
        quota: id.clone(),
        reasons: vec![format!("{e} while checking GpuQuota {id}")],
    };
    let status = written.status.clone().unwrap_or_default();
    let reserved: HashMap<ReservationKey, &Reservation> = status
        .reservations
        .iter()
        .filter(|r| r.state == ReservationState::Reserved)
        .map(|r| (r.key(), r))
        .collect();
    let borrowers: Vec<(usize, &Charge, ReservationKey)> = ops
        .iter()
        .zip(outcomes)
        .enumerate()
        .filter_map(|(i, (op, outcome))| match (op, outcome) {
            (Op::Reserve { charge, .. }, Outcome::Fits(fit)) if !fit.borrowed.is_empty() => {
                Some((i, charge, op.key()))
            }
            _ => None,
        })
        .collect();
    let mut consumed = match status.consumed(None) {
        Ok(c) => c,
        Err(e) => {
            return borrowers
                .iter()
                .map(|(i, ..)| (*i, fail(e.clone())))
                .collect()
        }
    };
    // Walk back from the last borrower, taking each one's reservation out before checking it.
    let mut out = Vec::new();
    for (i, charge, key) in borrowers.iter().rev() {
        if let Some(r) = reserved.get(key) {
            match consumed.saturating_sub(&r.charge) {
                Ok(c) => consumed = c,
                Err(e) => {
                    out.push((*i, fail(e)));
                    continue;
                }
            }
        }
        // `consumed` now holds everything but this borrower and those after it.
        if let Err(d) = check_consumed(written, &consumed, fresh_peers, charge) {
            out.push((*i, d));
        }
    }
    out.reverse();
    out
}

/// Whether any outcome borrows from the cohort (the batch then needs [`stale_borrowers`]).
pub fn borrows(outcomes: &[Outcome]) -> bool {
    outcomes
        .iter()
        .any(|o| matches!(o, Outcome::Fits(f) if !f.borrowed.is_empty()))
}
