//! Leader election decisions over a coordination.k8s.io/v1 Lease, as plain functions of what
//! was read and a clock passed in (the I/O is the shell's `controller/elector.rs`, which passes
//! its runtime's clock as `std::time::Instant`).
//!
//! The rules, as client-go's leader election has them:
//! - Expiry is judged on the *reader's* clock, never by comparing `renewTime` with local time
//!   (replicas' clocks may disagree): a candidate notes when it first saw the Lease's current
//!   version and considers the holder gone once `leaseDurationSeconds` pass on its own clock
//!   without a new version.
//! - A leader that cannot renew within `renew_deadline` (shorter than the lease duration),
//!   counted from the *start* of its last successful renew request, stops leading. The write
//!   happened after that start and any follower saw it no earlier, so the leader has stopped
//!   before any follower's `lease_duration` from that write can run out: two leaders never
//!   overlap while clocks run at the same rate.
//! - A Lease without a holder (released on shutdown) may be taken at once.

use std::time::{Duration, Instant};

/// Timings of the election.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTimings {
    /// How long a Lease stays valid without renewal (`leaseDurationSeconds`; whole seconds,
    /// at least one).
    pub lease_duration: Duration,
    /// How long a leader keeps leading without a successful renewal; less than
    /// `lease_duration`.
    pub renew_deadline: Duration,
    /// How often candidates and the leader read and write the Lease; less than
    /// `renew_deadline`.
    pub retry_period: Duration,
}

impl Default for LeaseTimings {
    /// client-go's defaults: 15 s, 10 s, 2 s.
    fn default() -> Self {
        LeaseTimings {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

impl LeaseTimings {
    /// Checks the ordering `retry_period < renew_deadline < lease_duration` and that the
    /// lease duration is whole seconds.
    pub fn validate(&self) -> Result<(), String> {
        if self.lease_duration.as_secs() == 0 || self.lease_duration.subsec_nanos() != 0 {
            return Err(format!(
                "lease duration {:?} must be whole seconds, at least 1",
                self.lease_duration
            ));
        }
        if self.renew_deadline >= self.lease_duration {
            return Err(format!(
                "renew deadline {:?} must be shorter than the lease duration {:?}",
                self.renew_deadline, self.lease_duration
            ));
        }
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            return Err(format!(
                "retry period {:?} must be positive and shorter than the renew deadline {:?}",
                self.retry_period, self.renew_deadline
            ));
        }
        Ok(())
    }

    /// `leaseDurationSeconds` for the Lease object.
    pub fn lease_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }
}

/// The parts of a Lease the decisions read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    /// `spec.holderIdentity`; `None` when absent or empty (released).
    pub holder: Option<String>,
    /// `spec.leaseDurationSeconds` (the holder's promise); missing counts as the reader's own.
    pub duration: Option<Duration>,
    /// `metadata.resourceVersion`: every renewal changes it.
    pub version: String,
}

/// What a candidate knows of the Lease: its last view and when (on the candidate's clock) that
/// version was first seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub view: LeaseView,
    pub seen_at: Instant,
}

/// Folds a new read into the observation: the clock restarts only when the version changed.
pub fn observe(prev: Option<&Observation>, view: LeaseView, now: Instant) -> Observation {
    match prev {
        Some(p) if p.view.version == view.version => Observation {
            view,
            seen_at: p.seen_at,
        },
        _ => Observation { view, seen_at: now },
    }
}

/// What a candidate should do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No Lease exists: create it naming ourselves.
    Create,
    /// We hold it: write a fresh `renewTime`.
    Renew,
    /// It has no holder or the holder let it expire: take it over (`leaseTransitions` + 1).
    TakeOver,
    /// Another candidate holds a live Lease, which expires at `expires` on our clock unless
    /// renewed.
    Follow { holder: String, expires: Instant },
}

/// The decision for candidate `me`, given the observed Lease (`None`: there is none).
pub fn decide(
    me: &str,
    observed: Option<&Observation>,
    now: Instant,
    timings: &LeaseTimings,
) -> Decision {
    let Some(obs) = observed else {
        return Decision::Create;
    };
    let Some(holder) = obs.view.holder.as_deref() else {
        return Decision::TakeOver;
    };
    if holder == me {
        return Decision::Renew;
    }
    let duration = obs.view.duration.unwrap_or(timings.lease_duration);
    let expires = obs.seen_at + duration;
    if now >= expires {
        Decision::TakeOver
    } else {
        Decision::Follow {
            holder: holder.to_string(),
            expires,
        }
    }
}

/// Whether a leader whose last successful renew request *started* at `renewed_at` still leads.
pub fn still_leading(renewed_at: Instant, now: Instant, timings: &LeaseTimings) -> bool {
    now < renewed_at + timings.renew_deadline
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timings() -> LeaseTimings {
        LeaseTimings {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    fn view(holder: Option<&str>, version: &str) -> LeaseView {
        LeaseView {
            holder: holder.map(str::to_string),
            duration: Some(Duration::from_secs(15)),
            version: version.into(),
        }
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_missing_lease_is_created_and_a_free_one_taken_at_once() {
        let t0 = Instant::now();
        assert_eq!(decide("a", None, t0, &timings()), Decision::Create);
        let obs = observe(None, view(None, "1"), t0);
        assert_eq!(decide("a", Some(&obs), t0, &timings()), Decision::TakeOver);
    }

    #[test]
    fn the_holder_renews_and_others_follow_until_the_lease_expires_on_their_clock() {
        let t0 = Instant::now();
        let obs = observe(None, view(Some("a"), "5"), t0);
        assert_eq!(decide("a", Some(&obs), t0, &timings()), Decision::Renew);
        assert_eq!(
            decide("b", Some(&obs), t0 + 14 * S, &timings()),
            Decision::Follow {
                holder: "a".into(),
                expires: t0 + 15 * S
            }
        );
        // Re-reading the same version does not restart the clock.
        let again = observe(Some(&obs), view(Some("a"), "5"), t0 + 10 * S);
        assert_eq!(again.seen_at, t0);
        assert_eq!(
            decide("b", Some(&again), t0 + 15 * S, &timings()),
            Decision::TakeOver
        );
    }

    #[test]
    fn a_renewal_restarts_the_followers_clock() {
        let t0 = Instant::now();
        let obs = observe(None, view(Some("a"), "5"), t0);
        let renewed = observe(Some(&obs), view(Some("a"), "6"), t0 + 12 * S);
        assert_eq!(renewed.seen_at, t0 + 12 * S);
        assert!(matches!(
            decide("b", Some(&renewed), t0 + 20 * S, &timings()),
            Decision::Follow { .. }
        ));
        assert_eq!(
            decide("b", Some(&renewed), t0 + 27 * S, &timings()),
            Decision::TakeOver
        );
    }

    #[test]
    fn the_holders_promised_duration_wins_over_the_readers_own() {
        let t0 = Instant::now();
        let mut v = view(Some("a"), "1");
        v.duration = Some(60 * S);
        let obs = observe(None, v, t0);
        assert!(matches!(
            decide("b", Some(&obs), t0 + 30 * S, &timings()),
            Decision::Follow { .. }
        ));
        let mut v = view(Some("a"), "1");
        v.duration = None;
        let obs = observe(None, v, t0);
        assert_eq!(
            decide("b", Some(&obs), t0 + 15 * S, &timings()),
            Decision::TakeOver
        );
    }

    #[test]
    fn a_leader_steps_down_before_any_follower_can_take_over() {
        let t = timings();
        let start = Instant::now();
        // The write lands somewhere after the request started; a follower sees it later still.
        for (write_after, seen_after) in [(0, 0), (1, 0), (3, 2), (9, 0)] {
            let seen_at = start + write_after * S + seen_after * S;
            let obs = observe(None, view(Some("a"), "9"), seen_at);
            let mut now = start;
            while now < start + 40 * S {
                let follower_takes = decide("b", Some(&obs), now, &t) == Decision::TakeOver;
                assert!(
                    !(follower_takes && still_leading(start, now, &t)),
                    "overlap at {:?}",
                    now - start
                );
                now += Duration::from_millis(100);
            }
        }
        assert!(still_leading(start, start + 9 * S, &t));
        assert!(!still_leading(start, start + 10 * S, &t));
    }

    #[test]
    fn timings_must_be_ordered_and_whole_seconds() {
        assert!(timings().validate().is_ok());
        assert!(LeaseTimings::default().validate().is_ok());
        let mut t = timings();
        t.renew_deadline = 15 * S;
        assert!(t.validate().is_err());
        let mut t = timings();
        t.retry_period = 10 * S;
        assert!(t.validate().is_err());
        let mut t = timings();
        t.lease_duration = Duration::from_millis(1500);
        assert!(t.validate().is_err());
        assert_eq!(timings().lease_seconds(), 15);
    }
}
