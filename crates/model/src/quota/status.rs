//! Reservations in a GpuQuota's status (pure): recording, releasing, totals, and which ones
//! are stale.

use super::clock::{age, rfc3339};
use super::crd::{GpuQuotaStatus, ObjectKind, QuotaCondition, Reservation, ReservationState};
use super::ratio::QuotaMathError;
use super::usage::Usage;
use k8s_openapi::jiff::Timestamp;
use std::collections::BTreeMap;
use std::time::Duration;

/// How long a reservation may wait for its object to show up (or a replaced object's
/// reservation may live) before [`stale_reservations`] drops it.
pub const DEFAULT_RESERVATION_GRACE: Duration = Duration::from_secs(120);

/// The most reservations a GpuQuota's status holds, whatever the load: it bounds the
/// status's size (etcd refuses an object over ~1.5 MiB; see the size test in `tests.rs`).
/// Past it, an admission that needs a new entry is refused as retryable backpressure
/// ([`super::Outcome::Backpressure`]), a gated pod is not recorded (its gate holds it), and the
/// controller releases no more queued pods than it has room to record. Entries are dropped as
/// soon as the controller sees their object counted, so the refusals last as long as its
/// caches lag.
pub const MAX_RESERVATIONS: usize = 384;

/// A reservation's identity: kind, namespace and name (no uid: the mutating webhook never
/// sees one, and a retried create must find its own reservation).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReservationKey {
    pub kind: ObjectKind,
    pub namespace: String,
    pub name: String,
}

impl ReservationKey {
    pub fn pod(namespace: &str, name: &str) -> Self {
        ReservationKey {
            kind: ObjectKind::Pod,
            namespace: namespace.into(),
            name: name.into(),
        }
    }
    pub fn claim(namespace: &str, name: &str) -> Self {
        ReservationKey {
            kind: ObjectKind::ResourceClaim,
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for ReservationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            ObjectKind::Pod => "pod",
            ObjectKind::ResourceClaim => "resourceclaim",
        };
        write!(f, "{kind} {}/{}", self.namespace, self.name)
    }
}

impl Reservation {
    pub fn key(&self) -> ReservationKey {
        ReservationKey {
            kind: self.kind,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    pub fn since_time(&self) -> Option<Timestamp> {
        self.since.parse().ok()
    }
}

/// Puts condition `c` in `conds`, replacing the one of its type; its `lastTransitionTime`
/// stays as it was while the status does not change, else becomes `now`.
pub fn set_condition(conds: &mut Vec<QuotaCondition>, mut c: QuotaCondition, now: Timestamp) {
    let pos = conds.iter().position(|o| o.type_ == c.type_);
    c.last_transition_time = match pos.map(|i| &conds[i]) {
        Some(o) if o.status == c.status => o.last_transition_time.clone(),
        _ => rfc3339(now),
    };
    match pos {
        Some(i) => conds[i] = c,
        None => conds.push(c),
    }
}

impl GpuQuotaStatus {
    pub fn reservation(&self, key: &ReservationKey) -> Option<&Reservation> {
        self.reservations.iter().find(|r| r.key() == *key)
    }

    /// How many new reservations may still be recorded: [`MAX_RESERVATIONS`] less the entries
    /// held and the room kept for what each escrow holder may flush
    /// ([`super::escrow::MAX_UNFLUSHED`] each).
    pub fn room(&self) -> usize {
        let kept = self
            .escrows
            .len()
            .saturating_mul(super::escrow::MAX_UNFLUSHED);
        MAX_RESERVATIONS.saturating_sub(self.reservations.len().saturating_add(kept))
    }

    /// Records `r`, replacing a reservation with the same key, and recomputes the totals.
    pub fn upsert(&mut self, r: Reservation) -> Result<(), QuotaMathError> {
        let key = r.key();
        match self.reservations.iter_mut().find(|x| x.key() == key) {
            Some(x) => *x = r,
            None => self.reservations.push(r),
        }
        self.recompute_totals()
    }

    /// Removes the reservation with `key` (if any) and recomputes the totals.
    pub fn release(&mut self, key: &ReservationKey) -> Result<Option<Reservation>, QuotaMathError> {
        let pos = self.reservations.iter().position(|x| x.key() == *key);
        let out = pos.map(|p| self.reservations.remove(p));
        self.recompute_totals()?;
        Ok(out)
    }

    /// Turns a queued reservation into a reserved one (the controller admits it), keeping its
    /// charge unless `charge` gives a new one. False when there is no such reservation.
    pub fn admit_queued(
        &mut self,
        key: &ReservationKey,
        charge: Option<Usage>,
    ) -> Result<bool, QuotaMathError> {
        let Some(r) = self.reservations.iter_mut().find(|x| x.key() == *key) else {
            return Ok(false);
        };
        r.state = ReservationState::Reserved;
        if let Some(c) = charge {
            r.charge = c;
            r.unpriced.clear();
        }
        self.recompute_totals()?;
        Ok(true)
    }

    /// `reserved` and `queued` from the reservations.
    pub fn recompute_totals(&mut self) -> Result<(), QuotaMathError> {
        self.reserved = Usage::sum(
            self.reservations
                .iter()
                .filter(|r| r.state == ReservationState::Reserved)
                .map(|r| &r.charge),
        )?;
        self.queued = Usage::sum(
            self.reservations
                .iter()
                .filter(|r| r.state == ReservationState::Queued)
                .map(|r| &r.charge),
        )?;
        Ok(())
    }

    /// What counts against `hard`: `used`, every escrow, plus every `Reserved` reservation
    /// except `excluding` (an object being re-admitted is not counted twice).
    pub fn consumed(&self, excluding: Option<&ReservationKey>) -> Result<Usage, QuotaMathError> {
        let mut total = self.used.clone();
        for e in &self.escrows {
            total.add_assign(&e.amount)?;
        }
        for r in &self.reservations {
            if r.state == ReservationState::Reserved && Some(&r.key()) != excluding {
                total.add_assign(&r.charge)?;
            }
        }
        Ok(total)
    }

    /// Queued reservations in admission order: higher priority first, then oldest first, then
    /// by key.
    pub fn queue_order(&self) -> Vec<&Reservation> {
        let mut q: Vec<&Reservation> = self
            .reservations
            .iter()
            .filter(|r| r.state == ReservationState::Queued)
            .collect();
        q.sort_by(|a, b| {
            b.priority
                .unwrap_or(0)
                .cmp(&a.priority.unwrap_or(0))
                .then_with(|| a.since_time().cmp(&b.since_time()))
                .then_with(|| a.key().cmp(&b.key()))
        });
        q
    }
}

/// What the controller knows of a live object a reservation may be for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LiveObject {
    pub uid: Option<String>,
    /// The controller counts this object in `status.used` (running pod, allocated claim):
    /// its reservation is superseded.
    pub counted: bool,
}

/// The reservations to drop, given the live objects (by key) the controller sees:
/// - one whose object is counted in `used` (same uid, or a uid unknown on either side), at once;
/// - one older than `grace` whose object does not exist (its create failed, or it was
///   deleted before running);
/// - one older than `grace` whose uid differs from the live object's (the create it was made
///   for failed against an existing object of that name, or the object was re-created).
///
/// `grace` covers the time between admission and the object reaching the controller's cache;
/// a reservation whose time cannot be read counts as old.
pub fn stale_reservations(
    status: &GpuQuotaStatus,
    live: &BTreeMap<ReservationKey, LiveObject>,
    now: Timestamp,
    grace: Duration,
) -> Vec<ReservationKey> {
    let mut out = Vec::new();
    for r in &status.reservations {
        let key = r.key();
        let old = match r.since_time() {
            Some(t) => age(t, now).is_some_and(|a| a >= grace),
            None => true,
        };
        let stale = match live.get(&key) {
            Some(l) => match (&r.uid, &l.uid) {
                // Another object of that name: this reservation's create never happened.
                (Some(a), Some(b)) if a != b => old,
                _ => l.counted,
            },
            None => old,
        };
        if stale {
            out.push(key);
        }
    }
    out
}
