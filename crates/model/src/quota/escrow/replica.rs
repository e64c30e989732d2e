//! One webhook replica's side of escrow (see [`super`] for the protocol): what the fast path
//! may admit within its share of a quota's headroom, and what the batch task owes the share
//! (flush, refill, give back). Plain state with the clock passed in; the webhook keeps it
//! under its queue's lock and does the writes (`webhook/commit.rs`).

use super::{fits, priced, MAX_UNFLUSHED, SPEND_WINDOW};
use crate::quota::{Limits, Op, Reservation, ReservationKey, Usage};
use std::time::{Duration, Instant};

/// Admissions made within an escrow are recorded (one write) at most this often.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(500);

/// An escrow is given back after this long without admissions to its quota.
pub const IDLE_RETURN: Duration = Duration::from_millis(250);

/// This replica's escrow for one quota. The status holds `cap` for it (as of its last
/// successful write); `unflushed` are admissions made within it and not yet written as
/// reservations (`spent`: their charge). Outside a write the fast path may admit while
/// `spent + charge <= cap`; during one, only within the budget of the write in flight.
#[derive(Debug, Default)]
pub struct LocalEscrow {
    cap: Usage,
    flight: Option<Flight>,
    unflushed: Vec<Reservation>,
    spent: Usage,
    /// The quota's `hard` and whether it takes escrows, as of the last batch.
    hard: Limits,
    eligible: bool,
    /// When `cap` was last written.
    written: Option<Instant>,
    last_flush: Option<Instant>,
    /// The latest admission: what the next escrow is sized by, and when.
    unit: Option<Usage>,
    last_admit: Option<Instant>,
}

/// A write in flight that records the first `recorded` of the unflushed admissions
/// (`flushed`: their charge) and sets the escrow to a new amount.
#[derive(Debug)]
struct Flight {
    recorded: usize,
    flushed: Usage,
    /// What admissions made during the write may take: what both the old escrow (less the
    /// recorded ones) and the new one cover, so the status covers them whatever the write's
    /// fate.
    budget: Usage,
}

/// What the batch task owes an escrow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EscrowDue {
    Now,
    In(Duration),
    Nothing,
}

impl LocalEscrow {
    /// The quota as the batch read it: its `hard`, and whether it takes escrows (and this
    /// replica uses them).
    pub fn set_quota(&mut self, hard: Limits, eligible: bool) {
        self.hard = hard;
        self.eligible = eligible;
    }

    /// The quota's `hard` as of the last batch.
    pub fn hard(&self) -> &Limits {
        &self.hard
    }

    /// The admissions made within the escrow and not yet recorded as reservations.
    pub fn unflushed(&self) -> &[Reservation] {
        &self.unflushed
    }

    /// An admission decided by a batch (not within the escrow): the next escrow is sized by
    /// its `charge`, and the quota counts as busy from `now`.
    pub fn admitted(&mut self, charge: Usage, now: Instant) {
        self.unit = Some(charge);
        self.last_admit = Some(now);
    }

    /// What the batch task owes the escrow at `now`.
    pub fn due(&self, now: Instant) -> EscrowDue {
        let after = |t: Option<Instant>, d: Duration| match t {
            Some(t) if now.duration_since(t) < d => EscrowDue::In(d - now.duration_since(t)),
            _ => EscrowDue::Now,
        };
        if !self.unflushed.is_empty() && self.low() {
            EscrowDue::Now
        } else if !self.unflushed.is_empty() {
            after(self.last_flush, FLUSH_INTERVAL)
        } else if !self.cap.is_zero() {
            after(self.last_admit, IDLE_RETURN)
        } else {
            EscrowDue::Nothing
        }
    }

    /// Less than half of the escrow is left (and no write is re-sizing it): refill now rather
    /// than let the fast path run dry and admissions wait for a write.
    pub fn low(&self) -> bool {
        if self.flight.is_some() || self.cap.is_zero() {
            return false;
        }
        let left = self.cap.saturating_sub(&self.spent).unwrap_or_default();
        left.checked_mul_int(2)
            .is_ok_and(|twice| !fits(&self.hard, &twice, &self.cap))
    }

    /// What the next escrow is sized by: the latest charge asked for in this batch, or of a
    /// recent admission; none (give it back) when idle or not eligible.
    pub fn wanted(&self, ops: &[Op], now: Instant) -> Option<Usage> {
        if !self.eligible {
            return None;
        }
        let asked = ops.iter().rev().find_map(|op| match op {
            Op::Reserve { charge, .. } if priced(&self.hard, charge) => Some(charge.usage.clone()),
            _ => None,
        });
        asked.or_else(|| {
            self.last_admit
                .filter(|t| now.duration_since(*t) < IDLE_RETURN)
                .and(self.unit.clone())
        })
    }

    /// Whether the admission at `i` of `unflushed` is being written now (it then stays).
    fn in_flight(&self, i: usize) -> bool {
        self.flight.as_ref().is_some_and(|f| i < f.recorded)
    }

    /// Admits `r` within the escrow, if it may (a retried create replaces its own earlier
    /// admission).
    pub fn admit(&mut self, r: &Reservation, now: Instant) -> bool {
        if !self.eligible
            || self
                .written
                .is_none_or(|t| now.duration_since(t) >= SPEND_WINDOW)
        {
            return false;
        }
        let key = r.key();
        let earlier = self.unflushed.iter().position(|x| x.key() == key);
        if earlier.is_some_and(|i| self.in_flight(i)) {
            return false;
        }
        let spent = match earlier {
            Some(i) => self.spent.saturating_sub(&self.unflushed[i].charge),
            None => Ok(self.spent.clone()),
        };
        let Ok(spent) = spent else { return false };
        // The status keeps room for this many entries of this holder's flush, no more.
        if earlier.is_none() && self.unflushed.len() >= MAX_UNFLUSHED {
            return false;
        }
        let available = match &self.flight {
            Some(f) => spent
                .saturating_sub(&f.flushed)
                .and_then(|after| f.budget.saturating_sub(&after)),
            None => self.cap.saturating_sub(&spent),
        };
        let Ok(available) = available else {
            return false;
        };
        if !fits(&self.hard, &available, &r.charge) {
            return false;
        }
        let Ok(spent) = spent.checked_add(&r.charge) else {
            return false;
        };
        match earlier {
            Some(i) => self.unflushed[i] = r.clone(),
            None => self.unflushed.push(r.clone()),
        }
        self.spent = spent;
        self.unit = Some(r.charge.clone());
        self.last_admit = Some(now);
        true
    }

    /// Takes back an admission made within the escrow and not being written.
    pub fn release(&mut self, key: &ReservationKey) -> bool {
        let Some(i) = self.unflushed.iter().position(|x| x.key() == *key) else {
            return false;
        };
        if self.in_flight(i) {
            return false;
        }
        self.unflushed.remove(i);
        self.resum();
        true
    }

    /// Starts a write that records every unflushed admission and sets the escrow to `new`.
    pub fn start_flight(&mut self, new: &Usage) {
        let left = self.cap.saturating_sub(&self.spent).unwrap_or_default();
        self.flight = Some(Flight {
            recorded: self.unflushed.len(),
            flushed: self.spent.clone(),
            budget: left.min(new),
        });
    }

    /// The write landed: the status holds `new`, and the recorded admissions are reservations.
    pub fn landed(&mut self, new: Usage, now: Instant) {
        if let Some(f) = self.flight.take() {
            self.unflushed.drain(..f.recorded.min(self.unflushed.len()));
        }
        self.cap = new;
        self.written = Some(now);
        self.last_flush = Some(now);
        self.resum();
    }

    /// `spent` from the unflushed admissions; an overflow stops the fast path until the
    /// next write.
    fn resum(&mut self) {
        match Usage::sum(self.unflushed.iter().map(|r| &r.charge)) {
            Ok(s) => self.spent = s,
            Err(_) => self.written = None,
        }
    }

    /// The write did not land (`maybe`: or may have): every admission stays for the next
    /// one; when it may have landed, the escrow counts as the smaller of the two (the
    /// recorded admissions count in both).
    pub fn not_landed(&mut self, maybe: bool, new: &Usage) {
        if let Some(f) = self.flight.take() {
            if maybe {
                self.cap = self
                    .cap
                    .min(&new.checked_add(&f.flushed).unwrap_or_default());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::{ObjectKind, ReservationState};
    use std::collections::BTreeMap;

    fn gpus(n: u64) -> Usage {
        Usage {
            devices: BTreeMap::from([("nvidia.com/gpu".to_string(), n)]),
            ..Usage::default()
        }
    }

    fn pod(name: &str) -> Reservation {
        Reservation {
            kind: ObjectKind::Pod,
            namespace: "ns".into(),
            name: name.into(),
            uid: None,
            state: ReservationState::Reserved,
            charge: gpus(1),
            unpriced: vec![],
            priority: None,
            since: "2026-01-01T00:00:00Z".into(),
        }
    }

    fn escrow() -> LocalEscrow {
        LocalEscrow {
            hard: Limits {
                devices: BTreeMap::from([("nvidia.com/gpu".to_string(), 100)]),
                ..Limits::default()
            },
            eligible: true,
            ..LocalEscrow::default()
        }
    }

    #[test]
    fn nothing_is_admitted_before_a_share_is_written_nor_beyond_it() {
        let now = Instant::now();
        let mut e = escrow();
        assert!(!e.admit(&pod("a"), now), "no share written yet");
        e.landed(gpus(2), now);
        assert!(e.admit(&pod("a"), now));
        // A retried create takes no second unit.
        assert!(e.admit(&pod("a"), now));
        assert!(e.admit(&pod("b"), now));
        assert!(!e.admit(&pod("c"), now), "beyond the share");
        assert!(e.low());
        // Past the spend window the share is not used, however much is left.
        let mut old = escrow();
        old.landed(gpus(2), now);
        assert!(!old.admit(&pod("a"), now + SPEND_WINDOW));
    }

    #[test]
    fn no_more_admissions_than_the_status_keeps_room_for_wait_for_a_flush() {
        let now = Instant::now();
        let mut e = escrow();
        e.landed(gpus(10_000), now);
        for i in 0..MAX_UNFLUSHED {
            assert!(e.admit(&pod(&format!("p{i}")), now));
        }
        assert!(!e.admit(&pod("one-more"), now), "the flush would not fit");
        assert!(
            e.admit(&pod("p0"), now),
            "a retried create needs no new entry"
        );
    }

    #[test]
    fn during_a_write_only_what_both_shares_cover_is_admitted_whatever_the_write_does() {
        let now = Instant::now();
        let mut e = escrow();
        e.landed(gpus(4), now);
        assert!(e.admit(&pod("a"), now));
        // The write records `a` and shrinks the share to 2: admissions during it may take what
        // both cover, min(4 - 1, 2) = 2.
        e.start_flight(&gpus(2));
        assert!(e.admit(&pod("b"), now));
        assert!(e.admit(&pod("c"), now));
        assert!(!e.admit(&pod("d"), now));
        // `a` is being written: neither released nor replaced meanwhile.
        assert!(!e.release(&ReservationKey::pod("ns", "a")));
        assert!(!e.admit(&pod("a"), now));
        assert!(e.release(&ReservationKey::pod("ns", "c")));
        assert!(e.admit(&pod("c"), now));

        // Timed out: it may have landed (share 2, `a` recorded) or not (share 4): the share
        // counts as min(4, 2 + 1) = 3 and every admission stays to be written again.
        let mut maybe = std::mem::take(&mut e);
        maybe.not_landed(true, &gpus(2));
        assert_eq!(maybe.cap, gpus(3));
        assert_eq!(maybe.unflushed.len(), 3);
        assert!(
            !maybe.admit(&pod("d"), now),
            "3 admitted of 3 covered either way"
        );

        // Landed: `a` is a reservation now, `b` and `c` are covered by the new share of 2.
        let mut landed = escrow();
        landed.landed(gpus(4), now);
        assert!(landed.admit(&pod("a"), now));
        landed.start_flight(&gpus(2));
        assert!(landed.admit(&pod("b"), now));
        landed.landed(gpus(2), now);
        let names: Vec<&str> = landed.unflushed.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["b"]);
        assert_eq!(landed.spent, gpus(1));
        assert!(landed.admit(&pod("c"), now));
        assert!(!landed.admit(&pod("d"), now));
    }

    #[test]
    fn a_share_is_owed_a_flush_while_admissions_wait_and_a_give_back_when_idle() {
        let now = Instant::now();
        let mut e = escrow();
        assert!(matches!(e.due(now), EscrowDue::Nothing));
        e.landed(gpus(8), now);
        assert!(
            matches!(e.due(now), EscrowDue::Now),
            "held, never used: give it back"
        );
        assert!(e.admit(&pod("a"), now));
        assert!(matches!(e.due(now), EscrowDue::In(d) if d <= FLUSH_INTERVAL));
        for n in ["b", "c", "d", "e"] {
            assert!(e.admit(&pod(n), now));
        }
        assert!(
            matches!(e.due(now), EscrowDue::Now),
            "half spent: refill now"
        );
        e.start_flight(&gpus(8));
        e.landed(gpus(8), now);
        assert!(matches!(e.due(now), EscrowDue::In(d) if d <= IDLE_RETURN));
        assert!(matches!(e.due(now + IDLE_RETURN), EscrowDue::Now));
    }
}
