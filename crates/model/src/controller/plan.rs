//! The release planner: which waiting pods (and pod groups) of one queue may have
//! their scheduling gate removed now. Pure: plain data in, a plan out, no clock and no I/O.
//!
//! # Order
//! Units (a pod, or a whole pod group) are considered in queue order: higher `priority`
//! first, then earlier creation, then name. Each unit that fits what is still free is
//! released and admitted into the ledger, so one cycle releases as many units as fit, not one
//! head per cycle. A group is one unit: all its members go in the same cycle or none does.
//!
//! # Who does not block the queue
//! - A group with fewer than `size` members waits for its members and holds nothing.
//! - A unit that needs more than the quota allows even when empty can never fit; it waits and
//!   holds nothing.
//!
//! # The starvation bound (the rule)
//! A unit that does not fit lets units behind it go ahead (backfill) only until it has waited
//! `bound` (since it became ready: creation of a pod, arrival of a group's last member). From
//! then on it is a *barrier*: nothing behind it in queue order is released, whatever fits,
//! until it is released itself.
//! So a unit that fits in the quota waits at most `bound`, plus the time the pods admitted
//! before that moment take to free enough capacity, plus one cycle, whatever arrives behind it.
//! Units ahead of it in order (higher priority, or older at equal priority) still go first:
//! the bound protects against those behind, as priorities mean.

use std::time::{Duration, SystemTime};

/// The quota a queue draws on, as the planner sees it. The arithmetic (and cohort borrowing)
/// belongs to the quota model; the planner only asks these questions, in queue order.
pub trait Ledger {
    type Charge;
    /// `Ok` when `charge` fits now, else why, with the numbers (for people).
    fn check(&self, charge: &Self::Charge) -> Result<(), String>;
    /// `Ok` when `charge` could fit if nothing else were held; else why.
    fn within_limits(&self, charge: &Self::Charge) -> Result<(), String>;
    /// Counts `charge` as admitted (called only after `check` said it fits).
    fn admit(&mut self, charge: &Self::Charge);
}

/// A unit waiting in a queue: one pod or one pod group.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting<C> {
    /// Pod name, or group name; unique within the queue.
    pub key: String,
    pub priority: i32,
    /// Queue position at equal priority (the earliest member's creation).
    pub created: SystemTime,
    /// When it became ready to go (the last member's creation for a group); the starvation
    /// bound counts from here.
    pub since: SystemTime,
    /// Charge of all its pods together.
    pub charge: C,
    /// For groups: members present and the group's size.
    pub group: Option<GroupCount>,
}

/// How many members of a pod group exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupCount {
    pub present: u32,
    pub size: u32,
}

impl<C> Waiting<C> {
    fn ready(&self) -> bool {
        self.group.is_none_or(|g| g.present >= g.size)
    }
}

/// Why a unit stays gated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitReason {
    /// A group waits for members.
    GroupIncomplete { present: u32, size: u32 },
    /// More than the quota allows even when empty: it cannot fit until the quota grows.
    ExceedsQuota(String),
    /// Not enough free now.
    Insufficient(String),
    /// It may fit, but `head` (ahead of it) has waited past the bound and goes first;
    /// `head_short` is why `head` waits.
    BehindStarved {
        head: String,
        waited: Duration,
        head_short: String,
    },
}

impl WaitReason {
    /// A short CamelCase tag, stable across numbers (Event reasons, change detection).
    pub fn kind(&self) -> &'static str {
        match self {
            WaitReason::GroupIncomplete { .. } => "GroupIncomplete",
            WaitReason::ExceedsQuota(_) => "ExceedsQuota",
            WaitReason::Insufficient(_) => "Insufficient",
            WaitReason::BehindStarved { .. } => "BehindStarved",
        }
    }
}

/// The unit at `queue[index]` is released: remove the gate from all its pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    pub index: usize,
}

/// The unit at `queue[index]` keeps waiting, for `reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wait {
    pub index: usize,
    pub reason: WaitReason,
}

/// The outcome of one planning cycle.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// In queue order.
    pub releases: Vec<Release>,
    /// In queue order.
    pub waits: Vec<Wait>,
    /// When a blocked unit will pass the bound and become a barrier: the plan may change then
    /// even if nothing else does.
    pub next_deadline: Option<SystemTime>,
}

/// Queue order: priority (high first), then creation, then key.
pub fn queue_order<C>(queue: &[Waiting<C>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..queue.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (&queue[a], &queue[b]);
        y.priority
            .cmp(&x.priority)
            .then(x.created.cmp(&y.created))
            .then(x.key.cmp(&y.key))
    });
    order
}

/// Plans one cycle for one queue, admitting into `ledger` what it releases. `bound` is the
/// starvation bound (zero: strict queue order, no backfill past a blocked unit).
pub fn plan_releases<L: Ledger>(
    queue: &[Waiting<L::Charge>],
    ledger: &mut L,
    now: SystemTime,
    bound: Duration,
) -> Plan {
    let mut releases = Vec::new();
    let mut waits = Vec::new();
    let mut barrier: Option<(String, Duration, String)> = None;
    let mut next_deadline: Option<SystemTime> = None;
    for index in queue_order(queue) {
        let unit = &queue[index];
        let reason = if let Some(g) = unit.group.filter(|_| !unit.ready()) {
            WaitReason::GroupIncomplete {
                present: g.present,
                size: g.size,
            }
        } else if let Err(why) = ledger.within_limits(&unit.charge) {
            WaitReason::ExceedsQuota(why)
        } else if let Some((head, waited, short)) = &barrier {
            WaitReason::BehindStarved {
                head: head.clone(),
                waited: *waited,
                head_short: short.clone(),
            }
        } else {
            match ledger.check(&unit.charge) {
                Ok(()) => {
                    ledger.admit(&unit.charge);
                    releases.push(Release { index });
                    continue;
                }
                Err(short) => {
                    let waited = now.duration_since(unit.since).unwrap_or(Duration::ZERO);
                    if waited >= bound {
                        barrier = Some((unit.key.clone(), waited, short.clone()));
                    } else {
                        let at = unit.since + bound;
                        next_deadline = Some(next_deadline.map_or(at, |d| d.min(at)));
                    }
                    WaitReason::Insufficient(short)
                }
            }
        };
        waits.push(Wait { index, reason });
    }
    Plan {
        releases,
        waits,
        next_deadline,
    }
}

#[cfg(test)]
mod tests;
