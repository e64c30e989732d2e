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
use crate::controller::plan::{queue_order, Plan, Release, Wait, WaitReason, Waiting};
use crate::controller::pods::PodRef;
use crate::controller::preempt::{choose_victims, Candidate, NoPreemption, Preemption, Preemptor};
use crate::controller::quota_ledger::Working;
use crate::quota::{Charge, QuotaMathError};

/// Units a namespace's cycle looks for victims for: each choice walks every candidate, and a
/// unit behind these gets its turn once they are released.
pub const MAX_PREEMPTORS: usize = 8;

/// The note kind of a unit that has pods evicted for it (or waits for their end).
pub const PREEMPTING: &str = "Preempting";

/// A pod to evict so that a waiting unit fits.
#[derive(Debug, Clone, PartialEq)]
pub struct Eviction {
    /// The pod, as it was chosen (its charge included: it counts as going until its quota's
    /// status no longer holds it).
    pub victim: Candidate,
    /// The waiting unit it makes room for (`pod ns/name` or its pod group).
    pub preemptor: String,
    /// The preemptor's pods, told by an Event that this pod is evicted for them.
    pub preemptor_pods: Vec<PodRef>,
    /// Why, for the victim's condition and Event.
    pub message: String,
}

/// What a cycle's preemption pass decided: the pods to evict, in the order chosen, and what
/// the pods of each unit it looked at are told.
#[derive(Debug, Default)]
pub(super) struct Choice {
    pub(super) evictions: Vec<Eviction>,
    /// Units that have pods evicted for them or wait for their victims: (unit, note).
    pub(super) preempting: Vec<(usize, String)>,
    /// Units no one may be evicted for, with why (appended to their note).
    pub(super) refused: Vec<(usize, String)>,
}

/// The units of a cycle: each unit, its members' indices into the queue, the queue.
type Parts<'p, 'a> = (&'p [Waiting<Charge>], &'p [Vec<usize>], &'p [Queued<'a>]);

/// Chooses victims for the units `plan` leaves short of quota (see the module's doc).
fn choose(
    input: &Inputs<'_>,
    (units, members, queued): Parts<'_, '_>,
    plan: &Plan,
    working: &Working,
) -> Result<Choice, QuotaMathError> {
    let ns = input.namespace;
    let mut out = Choice::default();
    if input.candidates.is_empty() || !working.quotas_in(ns).any(|q| q.spec.preemption.preempts()) {
        return Ok(out);
    }
    let mut w = working.clone();
    let mut candidates = input.candidates.to_vec();
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
        let said = match choose_victims(&preemptor, &w, &candidates) {
            Ok(Preemption::Fits) | Err(NoPreemption::Disabled(_)) => continue,
            Err(NoPreemption::Math(e)) => return Err(e),
            Err(e @ (NoPreemption::ExceedsQuota(_) | NoPreemption::NotEnough(_))) => {
                out.refused.push((index, e.to_string()));
                continue;
            }
            Ok(Preemption::Wait(going)) => format!(
                "waiting for quota: {short}; {} preempted pod(s) free enough once gone: {}",
                going.len(),
                names(&candidates, &going)
            ),
            Ok(Preemption::Evict(chosen)) => {
                let pods: Vec<PodRef> = members[index]
                    .iter()
                    .map(|&i| PodRef::of(queued[i].pod))
                    .collect();
                for &i in &chosen {
                    let c = &mut candidates[i];
                    c.terminating = true;
                    out.evictions.push(Eviction {
                        victim: c.clone(),
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
        out.preempting.push((index, said));
        // Its victims count as going in `candidates`; its charge is spoken for.
        w.hold(ns, &unit.charge.usage)?;
    }
    Ok(out)
}

/// The preemption pass of a cycle. `before` is the ledger as it was before the plan; the
/// victims are chosen on it with only the plan's releases ahead of the first unit left short
/// (so a smaller unit behind, which the plan let through on room the victims free, cannot
/// make the pass evict more). If any unit preempts, its charge is held, and the plan's
/// releases behind it are admitted again in queue order: those that no longer fit wait
/// ("room held for ..."). `working` becomes that ledger.
pub(super) fn preempt(
    input: &Inputs<'_>,
    parts: Parts<'_, '_>,
    plan: &mut Plan,
    before: Working,
    working: &mut Working,
) -> Result<Choice, QuotaMathError> {
    let (ns, units) = (input.namespace, parts.0);
    let mut pos = vec![0; units.len()];
    for (p, i) in queue_order(units).into_iter().enumerate() {
        pos[i] = p;
    }
    let first_short = plan
        .waits
        .iter()
        .filter(|w| matches!(w.reason, WaitReason::Insufficient(_)))
        .map(|w| pos[w.index])
        .min();
    let Some(first_short) = first_short else {
        return Ok(Choice::default());
    };
    let mut ledger = before;
    let (ahead, behind): (Vec<Release>, Vec<Release>) = std::mem::take(&mut plan.releases)
        .into_iter()
        .partition(|r| pos[r.index] < first_short);
    for r in &ahead {
        ledger.hold(ns, &units[r.index].charge.usage)?;
    }
    let choice = choose(input, parts, plan, &ledger)?;
    plan.releases = ahead;
    let Some((head, _)) = choice.preempting.first() else {
        plan.releases.extend(behind);
        return Ok(choice);
    };
    for (i, _) in &choice.preempting {
        ledger.hold(ns, &units[*i].charge.usage)?;
    }
    let head = &units[*head].key;
    for r in behind {
        let charge = &units[r.index].charge;
        match ledger.fits(ns, charge) {
            Ok(()) => {
                ledger.hold(ns, &charge.usage)?;
                plan.releases.push(r);
            }
            Err(short) => plan.waits.push(Wait {
                index: r.index,
                reason: WaitReason::Insufficient(format!(
                    "{short} (room held for {head}, which preempts pods for it)"
                )),
            }),
        }
    }
    *working = ledger;
    Ok(choice)
}

/// Rewrites the notes of the pods of the units `choice` looked at.
pub(super) fn tell(
    choice: &Choice,
    (units, members, queued): Parts<'_, '_>,
    waiting: &mut [(PodRef, Note)],
) {
    let uids = |i: usize| -> Vec<&str> {
        members[i]
            .iter()
            .filter_map(|&m| queued[m].pod.metadata.uid.as_deref())
            .collect()
    };
    for (i, said) in &choice.preempting {
        let unit = &units[*i];
        let who = unit
            .group
            .map(|_| format!("{} ({} pods waiting): ", unit.key, members[*i].len()))
            .unwrap_or_default();
        retell(waiting, &uids(*i), |_| {
            note(PREEMPTING, format!("{who}{said}"))
        });
    }
    for (i, why) in &choice.refused {
        retell(waiting, &uids(*i), |n| {
            note(n.kind, format!("{}; no preemption: {why}", n.message))
        });
    }
}

/// Rewrites the notes of the pods with `uids` in `waiting`.
fn retell(waiting: &mut [(PodRef, Note)], uids: &[&str], rewrite: impl Fn(&Note) -> Note) {
    for (p, n) in waiting.iter_mut() {
        if uids.contains(&p.uid.as_str()) {
            *n = rewrite(n);
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
