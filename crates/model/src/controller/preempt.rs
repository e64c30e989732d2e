//! Quota preemption, the decision (pure): which running pods a waiting pod or pod group may
//! have evicted so that it fits its namespace's GpuQuotas, under their `spec.preemption`
//! ([`crate::quota::PreemptionPolicy`]). The controller evicts the victims through the
//! Eviction API and keeps the unit gated until the planner sees it fit: victims count in
//! `used` until they are gone, so nothing is admitted over `hard` while they terminate. This
//! decision admits nothing; every fit question goes to the [`Working`] ledger
//! (`crate::quota::check`).
//!
//! # The rules
//! - Only for a unit that does not fit now but would fit its quotas were they empty
//!   (otherwise evicting cannot help), and only when every GpuQuota of its namespace is in
//!   Queue mode (Reject mode never preempts). The strictest policy among them applies.
//! - `withinQuota: LowerPriority`: pods of the unit's namespace of strictly lower priority.
//! - `reclaimWithinCohort`: pods of other namespaces whose GpuQuota shares a cohort with one of
//!   the unit's (`Any` priority, or `LowerPriority` only), and only while that quota consumes
//!   more than its `hard` in a dimension the unit needs and the pod holds: never more of its
//!   pods than end that borrowing. Pods of quotas outside the cohort are never victims.
//! - A pod group is one candidate, evicted whole or not at all: its priority is its members'
//!   highest, it started when its last member did, its charge is their sum.
//! - Order: lowest priority first, then most recently started (not started yet counts as the
//!   most recent), then namespace and name. Victims are taken in that order until the unit
//!   fits; then, walking the chosen ones backwards, each is dropped if the unit still fits
//!   without it. So no victim of the set can be spared alone.
//! - Pods already terminating (chosen in an earlier cycle, or deleted) are never chosen again;
//!   those the policy would let this unit evict are counted as going: if they free enough the
//!   answer is [`Preemption::Wait`], otherwise new victims are chosen for the rest.

use super::pods;
use super::quota_ledger::Working;
use crate::quota::{
    borrowing, Charge, QuotaMathError, QuotaMode, ReclaimWithinCohort, Usage, WithinQuota,
};
use k8s_openapi::api::core::v1::Pod;
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

/// The waiting unit that asks for room: a pod, or a pod group with its members' charges summed
/// and their highest priority.
#[derive(Debug, Clone, Copy)]
pub struct Preemptor<'a> {
    pub namespace: &'a str,
    pub priority: i32,
    pub charge: &'a Charge,
}

/// A pod that holds quota (counted in `used`: running, or admitted and not started yet) and
/// might be evicted.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Its namespace, whose GpuQuotas it is charged to.
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub priority: i32,
    /// When it started; `None`: not yet (counts as the most recent).
    pub started: Option<SystemTime>,
    pub charge: Charge,
    /// Its pod group, if any: the members are evicted together.
    pub group: Option<String>,
    /// Being deleted already: never chosen again, its charge counted as going.
    pub terminating: bool,
}

impl Candidate {
    /// A counted pod with its charge (as the controller priced it).
    pub fn of(pod: &Pod, charge: Charge) -> Candidate {
        Candidate {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            priority: pods::priority(pod),
            started: pods::started(pod),
            charge,
            group: pods::group(pod).map(|(name, _)| name),
            terminating: pods::is_deleting(pod),
        }
    }
}

/// What to do for a unit that waits on quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Preemption {
    /// It fits now: evict no one (the planner releases it).
    Fits,
    /// The pods already terminating (indices into the candidates, those of its namespace and
    /// cohorts) free enough once gone: evict no one more, wait for them.
    Wait(Vec<usize>),
    /// Evict these pods (indices into the candidates, in the order chosen, every member of a
    /// chosen group), then wait until they, and any pod already terminating, are gone.
    Evict(Vec<usize>),
}

/// Why no one is evicted for the unit, in words a user can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoPreemption {
    /// The policy or the mode rules preemption out.
    #[error("no preemption: {0}")]
    Disabled(String),
    /// More than its quotas allow even when empty: evicting cannot help.
    #[error("evicting cannot help: {0}")]
    ExceedsQuota(String),
    /// Even evicting every pod the policy allows would not make room.
    #[error("{0}")]
    NotEnough(String),
    #[error("{0} while choosing pods to preempt")]
    Math(#[from] QuotaMathError),
}

impl NoPreemption {
    /// A short CamelCase tag, stable across numbers (Event reasons, change detection).
    pub fn kind(&self) -> &'static str {
        match self {
            NoPreemption::Disabled(_) => "PreemptionDisabled",
            NoPreemption::ExceedsQuota(_) => "ExceedsQuota",
            NoPreemption::NotEnough(_) => "PreemptionNotEnough",
            NoPreemption::Math(_) => "QuotaMathError",
        }
    }
}

/// Chooses the pods to evict so that `unit` fits (see the module's rules). `working` holds
/// every quota of the cluster compacted (`status.used` = everything held, the candidates
/// included, as the planner sees it); `candidates` are the counted pods of the cluster (those
/// of other namespaces are ignored unless their quota shares a cohort with the unit's).
pub fn choose_victims(
    unit: &Preemptor<'_>,
    working: &Working,
    candidates: &[Candidate],
) -> Result<Preemption, NoPreemption> {
    if working.fits(unit.namespace, unit.charge).is_ok() {
        return Ok(Preemption::Fits);
    }
    working
        .within_limits(unit.namespace, unit.charge)
        .map_err(NoPreemption::ExceedsQuota)?;
    let policy = Policy::of(working, unit.namespace)?;
    let mut w = working.clone();
    // Terminating pods free their charge once gone: count them gone, never choose them again.
    let mut going = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        // Only what this unit could have had evicted: a pod of equal priority going for a
        // unit ahead makes no room for this one.
        if c.terminating && policy.allows(working, unit, &c.namespace, c.priority) {
            w.release(&c.namespace, &c.charge.usage)?;
            going.push(i);
        }
    }
    if !going.is_empty() && w.fits(unit.namespace, unit.charge).is_ok() {
        return Ok(Preemption::Wait(going));
    }
    let mut order: Vec<Victim<'_>> = victims(candidates)?
        .into_iter()
        .filter(|v| {
            !v.terminating
                && policy.allows(working, unit, v.namespace, v.priority)
                && !v.usage.min(&unit.charge.usage).is_zero()
        })
        .collect();
    order.sort_by(|a, b| {
        a.priority
            .cmp(&b.priority)
            .then_with(|| recency(b.started).cmp(&recency(a.started)))
            .then_with(|| (a.namespace, a.name).cmp(&(b.namespace, b.name)))
    });
    let chosen = take_until_fit(unit, &mut w, &policy, &order)?;
    let chosen = spare_unneeded(unit, &mut w, &order, chosen)?;
    Ok(Preemption::Evict(
        chosen.iter().flat_map(|&v| order[v].members()).collect(),
    ))
}

/// Sorts "not started" after every start, so that descending order puts it first.
fn recency(started: Option<SystemTime>) -> (bool, Option<SystemTime>) {
    (started.is_none(), started)
}

/// The strictest policy of a namespace's quotas.
struct Policy {
    within: bool,
    reclaim: ReclaimWithinCohort,
    /// The cohorts of the namespace's quotas.
    cohorts: BTreeSet<String>,
}

impl Policy {
    fn of(working: &Working, namespace: &str) -> Result<Policy, NoPreemption> {
        let mut within = true;
        let mut reclaim = ReclaimWithinCohort::Any;
        let mut cohorts = BTreeSet::new();
        for q in working.quotas_in(namespace) {
            if q.spec.mode != QuotaMode::Queue {
                return Err(NoPreemption::Disabled(format!(
                    "GpuQuota {} is in Reject mode, which never preempts",
                    q.id()
                )));
            }
            let p = q.spec.preemption;
            within &= p.within_quota == WithinQuota::LowerPriority;
            // Only a quota in a cohort has a say in reclaiming from it.
            if let Some(c) = &q.spec.cohort {
                cohorts.insert(c.clone());
                reclaim = stricter(reclaim, p.reclaim_within_cohort);
            }
        }
        if cohorts.is_empty() {
            reclaim = ReclaimWithinCohort::Never;
        }
        if !within && reclaim == ReclaimWithinCohort::Never {
            return Err(NoPreemption::Disabled(format!(
                "the GpuQuotas of namespace {namespace} allow none (spec.preemption: withinQuota and reclaimWithinCohort are Never, or left out, in at least one of them)"
            )));
        }
        Ok(Policy {
            within,
            reclaim,
            cohorts,
        })
    }

    /// Whether a quota of `namespace` is in one of the unit's cohorts.
    fn in_cohort(&self, working: &Working, namespace: &str) -> bool {
        working.quotas_in(namespace).any(|q| {
            q.spec
                .cohort
                .as_ref()
                .is_some_and(|c| self.cohorts.contains(c))
        })
    }

    /// Whether the policy lets `unit` evict a pod of `ns` at `priority` (the borrowing rule aside: that one changes as
    /// victims are taken, see [`still_borrowing`]).
    fn allows(&self, working: &Working, unit: &Preemptor<'_>, ns: &str, priority: i32) -> bool {
        if ns == unit.namespace {
            return self.within && priority < unit.priority;
        }
        let priority_ok = match self.reclaim {
            ReclaimWithinCohort::Any => true,
            ReclaimWithinCohort::LowerPriority => priority < unit.priority,
            ReclaimWithinCohort::Never => false,
        };
        priority_ok && self.in_cohort(working, ns)
    }

    /// The policy in words, for a refusal.
    fn describe(&self, unit: &Preemptor<'_>) -> String {
        let within = if self.within {
            format!(
                "pods of {} below priority {}",
                unit.namespace, unit.priority
            )
        } else {
            "no pod of its own namespace (withinQuota: Never)".to_string()
        };
        let cohorts: Vec<&str> = self.cohorts.iter().map(String::as_str).collect();
        let reclaim = match self.reclaim {
            ReclaimWithinCohort::Never => "none borrowed in its cohort".to_string(),
            ReclaimWithinCohort::Any => {
                format!("pods borrowing in cohort {}", cohorts.join(", "))
            }
            ReclaimWithinCohort::LowerPriority => format!(
                "pods below priority {} borrowing in cohort {}",
                unit.priority,
                cohorts.join(", ")
            ),
        };
        format!("{within}; {reclaim}")
    }
}

fn stricter(a: ReclaimWithinCohort, b: ReclaimWithinCohort) -> ReclaimWithinCohort {
    let rank = |r: ReclaimWithinCohort| match r {
        ReclaimWithinCohort::Never => 0,
        ReclaimWithinCohort::LowerPriority => 1,
        ReclaimWithinCohort::Any => 2,
    };
    if rank(a) <= rank(b) {
        a
    } else {
        b
    }
}

/// What is evicted as one: a pod, or every member of a pod group. Borrowed from the
/// candidates: a decision over a thousand pods copies none of them.
struct Victim<'a> {
    namespace: &'a str,
    /// The pod's, or the group's.
    name: &'a str,
    /// Indices into the candidates: the first member, then the others.
    first: usize,
    more: Vec<usize>,
    priority: i32,
    started: Option<SystemTime>,
    usage: Cow<'a, Usage>,
    /// A member is being deleted already.
    terminating: bool,
}

impl Victim<'_> {
    fn members(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(self.first).chain(self.more.iter().copied())
    }
}

/// The candidates as victims: pods alone, groups (by namespace and group name) whole.
fn victims(candidates: &[Candidate]) -> Result<Vec<Victim<'_>>, QuotaMathError> {
    let mut out: Vec<Victim<'_>> = Vec::new();
    let mut groups: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for (i, c) in candidates.iter().enumerate() {
        let key = c.group.as_deref().map(|g| (c.namespace.as_str(), g));
        if let Some(&at) = key.and_then(|k| groups.get(&k)) {
            let v = &mut out[at];
            v.more.push(i);
            v.priority = v.priority.max(c.priority);
            // A group started when its last member did; not at all while one has not.
            v.started = v.started.zip(c.started).map(|(a, b)| a.max(b));
            v.usage.to_mut().add_assign(&c.charge.usage)?;
            v.terminating |= c.terminating;
            continue;
        }
        if let Some(k) = key {
            groups.insert(k, out.len());
        }
        out.push(Victim {
            namespace: &c.namespace,
            name: c.group.as_deref().unwrap_or(&c.name),
            first: i,
            more: Vec::new(),
            priority: c.priority,
            started: c.started,
            usage: Cow::Borrowed(&c.charge.usage),
            terminating: c.terminating,
        });
    }
    Ok(out)
}

/// Whether a quota of `v`'s namespace in the unit's cohorts still consumes more than its
/// `hard` (with the victims taken so far gone from `w`) in a dimension the unit needs and `v`
/// holds.
fn still_borrowing(
    w: &Working,
    policy: &Policy,
    v: &Victim<'_>,
    need: &Usage,
) -> Result<bool, QuotaMathError> {
    let in_cohort = |c: &Option<String>| c.as_ref().is_some_and(|c| policy.cohorts.contains(c));
    for q in w
        .quotas_in(v.namespace)
        .filter(|q| in_cohort(&q.spec.cohort))
    {
        for (dim, _) in borrowing(q)? {
            if !need.get(&dim).is_zero() && !v.usage.get(&dim).is_zero() {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Takes victims in `order` out of `w` until `unit` fits; their positions in `order`.
fn take_until_fit(
    unit: &Preemptor<'_>,
    w: &mut Working,
    policy: &Policy,
    order: &[Victim<'_>],
) -> Result<Vec<usize>, NoPreemption> {
    let mut chosen = Vec::new();
    for (i, v) in order.iter().enumerate() {
        if v.namespace != unit.namespace && !still_borrowing(w, policy, v, &unit.charge.usage)? {
            continue;
        }
        w.release(v.namespace, &v.usage)?;
        chosen.push(i);
        if w.fits(unit.namespace, unit.charge).is_ok() {
            return Ok(chosen);
        }
    }
    let why = w
        .fits(unit.namespace, unit.charge)
        .err()
        .unwrap_or_default();
    let pods: usize = chosen.iter().map(|&i| 1 + order[i].more.len()).sum();
    Err(NoPreemption::NotEnough(if pods == 0 {
        format!(
            "no running pod may be evicted for it (the policy allows {}): {why}",
            policy.describe(unit)
        )
    } else {
        format!(
            "even evicting all {pods} pods the policy allows ({}) would leave: {why}",
            policy.describe(unit)
        )
    }))
}

/// Walks `chosen` backwards and drops each victim the unit fits without; `w` has every chosen
/// victim taken out and keeps exactly the remaining ones out.
fn spare_unneeded(
    unit: &Preemptor<'_>,
    w: &mut Working,
    order: &[Victim<'_>],
    mut chosen: Vec<usize>,
) -> Result<Vec<usize>, QuotaMathError> {
    for k in (0..chosen.len()).rev() {
        let v = &order[chosen[k]];
        w.hold(v.namespace, &v.usage)?;
        if w.fits(unit.namespace, unit.charge).is_ok() {
            chosen.remove(k);
        } else {
            w.release(v.namespace, &v.usage)?;
        }
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests;
