//! Preemption in a namespace's decision: for each unit the plan leaves short of quota (in
//! queue order, at most [`MAX_PREEMPTORS`] a cycle), whom to evict so that it fits
//! ([`choose_victims`]), and what its pods are told.
//!
//! Units are considered one after another on a copy of the ledger: each preempting unit's
//! charge is held there and its victims count as going, so a second unit never counts on
//! room a first one already claimed. Nothing here admits anything: the unit stays gated and
//! the planner releases it once its victims are gone from `status.used`.

use super::units::note;
use super::{Inputs, Note, Queued};
use crate::controller::ledger::Working;
use crate::controller::plan::{Plan, WaitReason, Waiting};
use crate::controller::pods::PodRef;
use crate::controller::preempt::{choose_victims, Candidate, NoPreemption, Preemption, Preemptor};
use crate::quota::{Charge, QuotaMathError};

/// Units a namespace's cycle looks for victims for: each choice walks every candidate, and a
/// unit behind these gets its turn once they are released.
pub const MAX_PREEMPTORS: usize = 8;

/// The note kind of a unit that has pods evicted for it (or waits for their end).
pub const PREEMPTING: &str = "Preempting";

/// A pod to evict so that a waiting unit fits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The waiting unit it makes room for (`pod ns/name` or its pod group).
    pub preemptor: String,
    /// The preemptor's pods, told by an Event that this pod is evicted for them.
    pub preemptor_pods: Vec<PodRef>,
    /// Why, for the victim's condition and Event.
    pub message: String,
}

/// Chooses victims for the units `plan` leaves short of quota and rewrites their pods' notes
/// in `waiting`; the pods to evict, in the order chosen.
pub(super) fn preempt(
    input: &Inputs<'_>,
    (units, members, queued): (&[Waiting<Charge>], &[Vec<usize>], &[Queued<'_>]),
    plan: &Plan,
    working: &Working,
    waiting: &mut [(PodRef, Note)],
) -> Result<Vec<Eviction>, QuotaMathError> {
    let ns = input.namespace;
    if input.candidates.is_empty() || !working.quotas_in(ns).any(|q| q.spec.preemption.preempts()) {
        return Ok(Vec::new());
    }
    let mut w = working.clone();
    let mut candidates = input.candidates.to_vec();
    let mut evictions = Vec::new();
    let short_units = plan.waits.iter().filter_map(|wait| match &wait.reason {
        WaitReason::Insufficient(short) => Some((wait.index, short)),
        _ => None,
    });
    for (index, short) in short_units.take(MAX_PREEMPTORS) {
        let unit = &units[index];
        let preemptor = Preemptor {
            namespace: ns,
            priority: unit.priority,
            charge: &unit.charge,
        };
        let pods: Vec<PodRef> = members[index]
            .iter()
            .map(|&i| PodRef::of(queued[i].pod))
            .collect();
        let said = match choose_victims(&preemptor, &w, &candidates) {
            Ok(Preemption::Fits) | Err(NoPreemption::Disabled(_)) => continue,
            Err(NoPreemption::Math(e)) => return Err(e),
            Err(e @ (NoPreemption::ExceedsQuota(_) | NoPreemption::NotEnough(_))) => {
                // It keeps waiting for quota; the note says why no one is evicted for it.
                retell(waiting, &pods, None, |m| format!("{m}; no preemption: {e}"));
                continue;
            }
            Ok(Preemption::Wait(going)) => {
                format!(
                    "waiting for quota: {short}; {} preempted pod(s) free enough once gone: {}",
                    going.len(),
                    names(&candidates, &going)
                )
            }
            Ok(Preemption::Evict(chosen)) => {
                for &i in &chosen {
                    let c = &mut candidates[i];
                    c.terminating = true;
                    evictions.push(Eviction {
                        namespace: c.namespace.clone(),
                        name: c.name.clone(),
                        uid: c.uid.clone(),
                        preemptor: unit.key.clone(),
                        preemptor_pods: pods.clone(),
                        message: victim_message(c, &preemptor, &unit.key),
                    });
                }
                format!(
                    "waiting for quota: {short}; preempting {} pod(s) of lower priority or borrowed capacity: {}",
                    chosen.len(),
                    names(&candidates, &chosen)
                )
            }
        };
        let who = unit
            .group
            .map(|_| format!("{} ({} pods waiting): ", unit.key, pods.len()))
            .unwrap_or_default();
        retell(waiting, &pods, Some(PREEMPTING), |_| format!("{who}{said}"));
        // Its victims count as going in `candidates`; its charge is spoken for.
        w.hold(ns, &unit.charge.usage)?;
    }
    Ok(evictions)
}

/// Rewrites the notes of `pods` in `waiting` (and their kind, when given).
fn retell(
    waiting: &mut [(PodRef, Note)],
    pods: &[PodRef],
    kind: Option<&'static str>,
    message: impl Fn(&str) -> String,
) {
    for (p, n) in waiting.iter_mut() {
        if pods.iter().any(|q| q.uid == p.uid) {
            *n = note(kind.unwrap_or(n.kind), message(&n.message));
        }
    }
}

/// `ns/name (priority p)`, comma-separated, for the candidates at `idx`.
fn names(candidates: &[Candidate], idx: &[usize]) -> String {
    idx.iter()
        .map(|&i| {
            let c = &candidates[i];
            format!("{}/{} (priority {})", c.namespace, c.name, c.priority)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// What an evicted pod is told.
fn victim_message(victim: &Candidate, by: &Preemptor<'_>, key: &str) -> String {
    let how = if victim.namespace == by.namespace {
        format!(
            "its priority {} is below the preemptor's {} and the GpuQuotas of namespace {} allow preemption within the quota (withinQuota: LowerPriority)",
            victim.priority, by.priority, by.namespace
        )
    } else {
        format!(
            "namespace {} borrows capacity of its cohort that namespace {} reclaims (reclaimWithinCohort)",
            victim.namespace, by.namespace
        )
    };
    let group = victim
        .group
        .as_ref()
        .map(|g| format!(" with the rest of pod group {g}"))
        .unwrap_or_default();
    format!(
        "preempted{group} to make room for {key} (priority {}): {how}",
        by.priority
    )
}
