//! Queued pods as the planner's units: single pods and pod groups, each with its members and
//! charge, and the notes that tell the waiting pods why.
//!
//! Pods that cannot be planned at all (no price, a bad group annotation) get their note here,
//! before planning; the rest get theirs from the plan's waits.

use super::{Inputs, Note, Queued};
use crate::controller::plan::{GroupCount, Plan, WaitReason, Waiting};
use crate::controller::pods::{self, PodRef};
use crate::quota::{missing_templates, waiting_message, Charge, QuotaMathError};
use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;
use std::time::SystemTime;

/// The planner's units, each unit's indices into the queue, and the notes of pods left out.
type Units = (Vec<Waiting<Charge>>, Vec<Vec<usize>>, Vec<(PodRef, Note)>);

/// Queued pods as planner units (single pods and groups); pods that cannot be planned at all
/// (no price, a bad group annotation) get their note here.
pub(super) fn build_units(
    input: &Inputs<'_>,
    queued: &[Queued<'_>],
) -> Result<Units, QuotaMathError> {
    let mut units = Vec::new();
    let mut members = Vec::new();
    let mut waiting = Vec::new();
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, q) in queued.iter().enumerate() {
        if let Err(e) = &q.charge {
            // Not created yet: the pod waits for it (and holds nothing) rather than failing.
            let missing = missing_templates(q.pod, input.templates);
            let n = if missing.is_empty() {
                note("Unpriced", e.clone())
            } else {
                note(
                    "WaitingForTemplate",
                    waiting_message(input.namespace, &missing),
                )
            };
            waiting.push((PodRef::of(q.pod), n));
            continue;
        }
        match pods::group(q.pod) {
            Some((name, _)) => groups.entry(name).or_default().push(i),
            None => {
                let created = pods::created(q.pod);
                units.push(Waiting {
                    key: pods::pod_key(&q.key.namespace, &q.key.name),
                    priority: pods::priority(q.pod),
                    created,
                    since: created,
                    charge: q.charge.clone().unwrap_or_default(),
                    group: None,
                });
                members.push(vec![i]);
            }
        }
    }
    let live_members = live_members(input);
    for (name, idx) in groups {
        let all = live_members
            .get(&name)
            .map(Vec::as_slice)
            .unwrap_or_default();
        match group_size(all) {
            Ok(size) => {
                units.push(group_unit(input, &name, &idx, all, size, queued)?);
                members.push(idx);
            }
            Err(e) => {
                for &i in &idx {
                    waiting.push((
                        PodRef::of(queued[i].pod),
                        note("BadGroup", format!("pod group {name}: {e}")),
                    ));
                }
            }
        }
    }
    Ok((units, members, waiting))
}

/// The live members of each pod group, by group name. Every live member counts toward the
/// size, gated or not.
fn live_members<'a>(input: &Inputs<'a>) -> BTreeMap<String, Vec<&'a Pod>> {
    let mut live_members: BTreeMap<String, Vec<&Pod>> = BTreeMap::new();
    for p in input
        .pods
        .iter()
        .filter(|p| !pods::is_terminal(p) && !pods::is_deleting(p))
    {
        if let Some((name, _)) = pods::group(p) {
            live_members.entry(name).or_default().push(p);
        }
    }
    live_members
}

/// A group's size: the largest its members declare; an error only when none declares one
/// that parses.
fn group_size(all: &[&Pod]) -> Result<u32, String> {
    let mut size: Result<u32, String> = Err(String::new());
    for p in all {
        if let Some((_, s)) = pods::group(p) {
            size = match (size, s) {
                (Ok(a), Ok(b)) => Ok(a.max(b)),
                (Err(_), Ok(b)) => Ok(b),
                (a, Err(e)) => a.or(Err(e)),
            };
        }
    }
    size
}

/// One pod group as a unit: the queued members `idx` with their summed charge, the highest
/// priority among them, and `all` its live members.
fn group_unit(
    input: &Inputs<'_>,
    name: &str,
    idx: &[usize],
    all: &[&Pod],
    size: u32,
    queued: &[Queued<'_>],
) -> Result<Waiting<Charge>, QuotaMathError> {
    let mut charge = Charge::default();
    for &i in idx {
        if let Ok(c) = &queued[i].charge {
            charge.add_assign(c)?;
        }
    }
    let created = idx.iter().map(|&i| pods::created(queued[i].pod)).min();
    let since = all.iter().map(|p| pods::created(p)).max();
    Ok(Waiting {
        key: pods::group_key(input.namespace, name),
        priority: idx
            .iter()
            .map(|&i| pods::priority(queued[i].pod))
            .max()
            .unwrap_or(0),
        created: created.unwrap_or(SystemTime::UNIX_EPOCH),
        since: since.unwrap_or(SystemTime::UNIX_EPOCH),
        charge,
        group: Some(GroupCount {
            present: u32::try_from(all.len()).unwrap_or(u32::MAX),
            size,
        }),
    })
}

pub(super) fn note(kind: &'static str, message: String) -> Note {
    Note { kind, message }
}

/// What each pod of a unit the plan holds back is told.
pub(super) fn notes(
    input: &Inputs<'_>,
    units: &[Waiting<Charge>],
    members: &[Vec<usize>],
    queued: &[Queued<'_>],
    plan: &Plan,
) -> Vec<(PodRef, Note)> {
    let mut out = Vec::new();
    for w in &plan.waits {
        let unit = &units[w.index];
        let who = if unit.group.is_some() {
            format!("{} ({} pods waiting): ", unit.key, members[w.index].len())
        } else {
            String::new()
        };
        let message = match &w.reason {
            WaitReason::GroupIncomplete { present, size } => {
                format!("{who}{present} of {size} members exist; released together once all do")
            }
            WaitReason::ExceedsQuota(why) => format!("{who}can never be admitted: {why}"),
            WaitReason::Insufficient(why) => format!("{who}waiting for quota: {why}"),
            WaitReason::BehindStarved {
                head,
                waited,
                head_short,
            } => format!(
                "{who}queued behind {head}, which has waited {}s (the bound is {}s) and goes first: {head_short}",
                waited.as_secs(),
                input.settings.bound.as_secs()
            ),
        };
        for &i in &members[w.index] {
            out.push((
                PodRef::of(queued[i].pod),
                note(w.reason.kind(), message.clone()),
            ));
        }
    }
    out
}
