//! One namespace's reconcile decision (pure): from its pods, claims and freshly read GpuQuotas,
//! what the quotas' status becomes (usage, stale reservations dropped, admissions recorded),
//! which gated pods are released, and what each waiting pod is told.
//!
//! The protocol with the webhook and the scheduler (see `crate::quota`'s contract):
//! - `status.used` is the charge of every pod that exists, is not finished and is not at the
//!   admission gate (pending or running, [`pods::is_counted`]), plus the
//!   settled charge of every allocated standalone ResourceClaim; reservations of counted
//!   objects and stale ones ([`stale_reservations`]) go in the same write.
//! - A gated pod is admitted by turning its reservation `Reserved` (creating one if the webhook
//!   could not record it) in every GpuQuota of its namespace; the gate is removed only after
//!   that write succeeded. A gated pod already `Reserved` everywhere (an earlier cycle wrote
//!   the status, then stopped) is released without planning.
//! - Everything else gated is planned by [`plan_releases`] against the compacted quotas.

use super::ledger::{compact, Working};
use super::plan::{plan_releases, GroupCount, Plan, WaitReason, Waiting};
use super::pods::{self, PodRef};
use crate::quota::escrow::stale_escrows;
use crate::quota::status::rfc3339;
use crate::quota::{
    claim_charge, claim_is_pod_owned, pod_charge, settled_claim_charge, stale_reservations, Charge,
    DeviceCatalog, GpuQuota, LiveObject, ObjectKind, QuotaCondition, QuotaMathError, QuotaMode,
    Reservation, ReservationKey, ReservationState, Usage,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimSpec};
use k8s_openapi::jiff::Timestamp;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The GpuQuota condition the controller keeps on Queue-mode quotas.
pub const QUEUE_CONDITION: &str = "QueueWaiting";

/// Tunables of the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSettings {
    /// The starvation bound (see `plan.rs`).
    pub bound: Duration,
    /// How long a reservation may wait for its object ([`stale_reservations`]).
    pub grace: Duration,
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings {
            bound: Duration::from_secs(120),
            grace: crate::quota::DEFAULT_RESERVATION_GRACE,
        }
    }
}

/// What one namespace's cycle reads.
pub struct Inputs<'a> {
    pub namespace: &'a str,
    pub pods: &'a [Arc<Pod>],
    pub claims: &'a [Arc<ResourceClaim>],
    /// The namespace's ResourceClaimTemplates by name.
    pub templates: &'a BTreeMap<String, ResourceClaimSpec>,
    pub catalog: &'a DeviceCatalog,
    pub now: SystemTime,
    pub settings: QueueSettings,
}

/// What a waiting pod is told, and a tag that changes only when the kind of reason does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub kind: &'static str,
    pub message: String,
}

/// The decision for one namespace.
#[derive(Debug, Clone, Default)]
pub struct Decision {
    /// The namespace's quotas as they should be written, with whether each changed.
    pub quotas: Vec<(GpuQuota, bool)>,
    /// Units released this cycle, each to be ungated as a whole.
    pub releases: Vec<Vec<PodRef>>,
    /// Pods admitted earlier and still gated: ungate now.
    pub admitted_gated: Vec<PodRef>,
    /// Every waiting pod with its note.
    pub waiting: Vec<(PodRef, Note)>,
    /// When the plan may change by time alone (a bound or a reservation grace running out).
    pub next_deadline: Option<SystemTime>,
}

/// A queued pod with its charge.
#[derive(Clone)]
struct Queued<'a> {
    pod: &'a Pod,
    key: ReservationKey,
    charge: Result<Charge, String>,
}

/// What a namespace's pods and claims come to, whatever its quotas say: usage, the live
/// objects reservations are matched with, and the gated pods priced. [`decide`] takes it apart
/// from the quotas so that a status write that conflicted is decided again from a fresh read
/// without pricing every pod again: the window between that read and the write stays short.
pub struct Observed<'a> {
    used: Usage,
    live: BTreeMap<ReservationKey, LiveObject>,
    gated: Vec<Queued<'a>>,
}

/// A pod's charge as last priced, by namespace and uid, with the resourceVersion it was priced
/// at: pricing every pod of a namespace on every reconcile held a worker for milliseconds with
/// a thousand pods. A charge also depends on the namespace's ResourceClaimTemplates and on the
/// device catalog; whoever feeds [`observe`] clears this when either changes.
#[derive(Debug, Default)]
pub struct Charges {
    by_namespace: HashMap<String, HashMap<String, Priced>>,
}

/// The resourceVersion a pod was priced at, and what it came to.
type Priced = (String, Result<Charge, String>);

impl Charges {
    pub fn clear(&mut self) {
        self.by_namespace.clear();
    }
}

/// Prices the pods and claims of `input` (see [`Observed`]); `charges` keeps the pods' charges
/// for the next call (only those of pods still there).
pub fn observe<'a>(
    input: &Inputs<'a>,
    charges: &mut Charges,
) -> Result<Observed<'a>, QuotaMathError> {
    let ns = input.namespace;
    let mut before = charges.by_namespace.remove(ns).unwrap_or_default();
    let mut kept = HashMap::new();
    let mut charge_of = |p: &Pod| {
        let (Some(uid), Some(rv)) = (&p.metadata.uid, &p.metadata.resource_version) else {
            return price(input, p);
        };
        let c = match before.remove(uid) {
            Some((at, c)) if at == *rv => c,
            _ => price(input, p),
        };
        kept.insert(uid.clone(), (rv.clone(), c.clone()));
        c
    };
    // Usage and live objects.
    let mut used = Usage::default();
    let mut live: BTreeMap<ReservationKey, LiveObject> = BTreeMap::new();
    for p in input.pods {
        let name = p.metadata.name.clone().unwrap_or_default();
        let counted = pods::is_counted(p);
        if counted {
            match charge_of(p) {
                Ok(c) => used.add_assign(&c.usage)?,
                Err(e) => {
                    tracing::warn!(pod = %format!("{ns}/{name}"), error = %e, "a running pod cannot be charged; not counted")
                }
            }
        }
        live.insert(
            ReservationKey::pod(ns, &name),
            LiveObject {
                uid: p.metadata.uid.clone(),
                counted: counted || pods::is_terminal(p),
            },
        );
    }
    for c in input.claims {
        let name = c.metadata.name.clone().unwrap_or_default();
        if claim_is_pod_owned(&c.metadata) {
            continue;
        }
        let settled = match settled_claim_charge(c, input.catalog) {
            Ok(Some(s)) if s.unknown.is_empty() => Some(s),
            Ok(Some(_)) => claim_charge(&c.spec, input.catalog).ok(),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(claim = %format!("{ns}/{name}"), error = %e, "an allocated claim cannot be charged; not counted");
                None
            }
        };
        if let Some(s) = &settled {
            used.add_assign(&s.usage)?;
        }
        live.insert(
            ReservationKey::claim(ns, &name),
            LiveObject {
                uid: c.metadata.uid.clone(),
                counted: settled.is_some(),
            },
        );
    }
    let gated = input
        .pods
        .iter()
        .filter(|p| pods::is_queued(p))
        .map(|p| Queued {
            pod: p,
            key: ReservationKey::pod(ns, p.metadata.name.as_deref().unwrap_or_default()),
            charge: charge_of(p),
        })
        .collect();
    charges.by_namespace.insert(ns.to_string(), kept);
    Ok(Observed { used, live, gated })
}

fn price(input: &Inputs<'_>, p: &Pod) -> Result<Charge, String> {
    pod_charge(p, input.templates, input.catalog).map_err(|e| format!("cannot be charged: {e}"))
}

/// Decides one namespace's cycle from what [`observe`] saw of it. `fresh` are its GpuQuotas
/// as just read; `working` holds every quota of the cluster (this namespace's are replaced by
/// compacted `fresh` ones and then charged with what is released, so later namespaces of a
/// cohort see it).
pub fn decide(
    input: &Inputs<'_>,
    observed: &Observed<'_>,
    fresh: &[GpuQuota],
    working: &mut Working,
) -> Result<Decision, QuotaMathError> {
    let ns = input.namespace;
    let now_ts = Timestamp::try_from(input.now).unwrap_or_else(|_| Timestamp::now());
    let (used, live) = (&observed.used, &observed.live);

    // Drop what is counted or stale.
    let mut quotas: Vec<GpuQuota> = fresh.to_vec();
    let mut next_deadline: Option<SystemTime> = None;
    for q in &mut quotas {
        let mut s = q.status_or_default();
        s.used = used.clone();
        let stale: BTreeSet<ReservationKey> =
            stale_reservations(&s, live, now_ts, input.settings.grace)
                .into_iter()
                .collect();
        if !stale.is_empty() {
            s.reservations.retain(|r| !stale.contains(&r.key()));
        }
        // An escrow its holder stopped renewing (the replica died): what it admitted exists
        // as pods by now.
        let dead = stale_escrows(&s, now_ts, input.settings.grace);
        s.escrows.retain(|e| !dead.contains(&e.holder));
        for e in &s.escrows {
            if let Ok(t) = e.renewed.parse::<Timestamp>() {
                let at = SystemTime::from(t) + input.settings.grace;
                next_deadline = Some(next_deadline.map_or(at, |d| d.min(at)));
            }
        }
        // A reservation without its object is dropped when its grace ends: wake up then.
        for r in &s.reservations {
            if !live.contains_key(&r.key()) {
                if let Some(t) = r.since_time() {
                    let at = SystemTime::from(t) + input.settings.grace;
                    next_deadline = Some(next_deadline.map_or(at, |d| d.min(at)));
                }
            }
        }
        s.recompute_totals()?;
        q.status = Some(s);
    }
    let reserved: Vec<BTreeSet<ReservationKey>> = quotas
        .iter()
        .map(|q| {
            q.status
                .iter()
                .flat_map(|s| &s.reservations)
                .filter(|r| r.state == ReservationState::Reserved)
                .map(|r| r.key())
                .collect()
        })
        .collect();
    let reserved_everywhere =
        |key: &ReservationKey| !reserved.is_empty() && reserved.iter().all(|r| r.contains(key));

    // The queue.
    let mut admitted_gated = Vec::new();
    let mut queued: Vec<Queued<'_>> = Vec::new();
    for g in &observed.gated {
        if reserved_everywhere(&g.key) {
            admitted_gated.push(PodRef::of(g.pod));
        } else {
            queued.push(g.clone());
        }
    }
    let exclude: BTreeSet<ReservationKey> = queued.iter().map(|q| q.key.clone()).collect();
    for q in &quotas {
        working.put(compact(q, &exclude)?);
    }
    let (units, members, mut waiting) = build_units(input, &queued)?;
    let plan = plan_releases(
        &units,
        &mut working.namespace(ns),
        input.now,
        input.settings.bound,
    );
    if let Some(d) = plan.next_deadline {
        next_deadline = Some(next_deadline.map_or(d, |x| x.min(d)));
    }

    // Record the admissions.
    let mut releases = Vec::new();
    let mut admitted: Vec<&Queued<'_>> = Vec::new();
    for r in &plan.releases {
        releases.push(
            members[r.index]
                .iter()
                .map(|&i| PodRef::of(queued[i].pod))
                .collect(),
        );
        admitted.extend(members[r.index].iter().map(|&i| &queued[i]));
    }
    if !admitted.is_empty() {
        for q in &mut quotas {
            let mut s = q.status_or_default();
            admit(&mut s, &admitted, now_ts);
            q.status = Some(s);
        }
    }
    waiting.extend(notes(input, &units, &members, &queued, &plan));

    let waiting_pods = waiting.len();
    let head = plan
        .waits
        .first()
        .map(|w| format!("; first: {} ({})", units[w.index].key, w.reason.kind()));
    let mut out = Vec::new();
    for (q, f) in quotas.into_iter().zip(fresh) {
        let mut q = q;
        let mut s = q.status_or_default();
        s.recompute_totals()?;
        s.observed_generation = q.metadata.generation;
        if q.spec.mode == QuotaMode::Queue {
            let (status, reason, message) = if waiting_pods == 0 {
                ("False", "Empty", "no pods waiting".to_string())
            } else {
                (
                    "True",
                    "PodsWaiting",
                    format!(
                        "{waiting_pods} pods waiting{}",
                        head.clone().unwrap_or_default()
                    ),
                )
            };
            set_condition(
                &mut s.conditions,
                status,
                reason,
                message,
                now_ts,
                q.metadata.generation,
            );
        }
        q.status = Some(s);
        let changed = q.status != f.status;
        out.push((q, changed));
    }
    Ok(Decision {
        quotas: out,
        releases,
        admitted_gated,
        waiting,
        next_deadline,
    })
}

/// Turns the reservations of `admitted` pods `Reserved` with their current charge, creating
/// those that are missing. Totals are recomputed by the caller.
fn admit(s: &mut crate::quota::GpuQuotaStatus, admitted: &[&Queued<'_>], now: Timestamp) {
    let mut at: BTreeMap<ReservationKey, usize> = s
        .reservations
        .iter()
        .enumerate()
        .map(|(i, r)| (r.key(), i))
        .collect();
    for qd in admitted {
        let charge = qd
            .charge
            .as_ref()
            .map(|c| c.usage.clone())
            .unwrap_or_default();
        match at.get(&qd.key) {
            Some(&i) => {
                let r = &mut s.reservations[i];
                r.state = ReservationState::Reserved;
                r.charge = charge;
                r.unpriced.clear();
                if r.uid.is_none() {
                    r.uid = qd.pod.metadata.uid.clone();
                }
            }
            None => {
                at.insert(qd.key.clone(), s.reservations.len());
                s.reservations.push(Reservation {
                    kind: ObjectKind::Pod,
                    namespace: qd.key.namespace.clone(),
                    name: qd.key.name.clone(),
                    uid: qd.pod.metadata.uid.clone(),
                    state: ReservationState::Reserved,
                    charge,
                    unpriced: Vec::new(),
                    priority: Some(pods::priority(qd.pod)),
                    since: rfc3339(now),
                });
            }
        }
    }
}

type Units = (Vec<Waiting<Charge>>, Vec<Vec<usize>>, Vec<(PodRef, Note)>);

/// Queued pods as planner units (single pods and groups); pods that cannot be planned at all
/// (no price, a bad group annotation) get their note here.
fn build_units(input: &Inputs<'_>, queued: &[Queued<'_>]) -> Result<Units, QuotaMathError> {
    let mut units = Vec::new();
    let mut members = Vec::new();
    let mut waiting = Vec::new();
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    // Every live member counts toward the size, gated or not.
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
    for (i, q) in queued.iter().enumerate() {
        if let Err(e) = &q.charge {
            waiting.push((PodRef::of(q.pod), note("Unpriced", e.clone())));
            continue;
        }
        match pods::group(q.pod) {
            Some((name, _)) => groups.entry(name).or_default().push(i),
            None => {
                let created = pods::created(q.pod);
                units.push(Waiting {
                    key: format!("pod {}/{}", q.key.namespace, q.key.name),
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
    for (name, idx) in groups {
        let all = live_members
            .get(&name)
            .map(Vec::as_slice)
            .unwrap_or_default();
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
        let size = match size {
            Ok(s) => s,
            Err(e) => {
                for &i in &idx {
                    waiting.push((
                        PodRef::of(queued[i].pod),
                        note("BadGroup", format!("pod group {name}: {e}")),
                    ));
                }
                continue;
            }
        };
        let mut charge = Charge::default();
        for &i in &idx {
            if let Ok(c) = &queued[i].charge {
                charge.add_assign(c)?;
            }
        }
        let created = idx.iter().map(|&i| pods::created(queued[i].pod)).min();
        let since = all.iter().map(|p| pods::created(p)).max();
        units.push(Waiting {
            key: format!("pod group {}/{name}", input.namespace),
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
        });
        members.push(idx);
    }
    Ok((units, members, waiting))
}

fn note(kind: &'static str, message: String) -> Note {
    Note { kind, message }
}

fn notes(
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

fn set_condition(
    conds: &mut Vec<QuotaCondition>,
    status: &str,
    reason: &str,
    message: String,
    now: Timestamp,
    generation: Option<i64>,
) {
    let pos = conds.iter().position(|c| c.type_ == QUEUE_CONDITION);
    let transition = match pos.map(|i| &conds[i]) {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => rfc3339(now),
    };
    let c = QuotaCondition {
        type_: QUEUE_CONDITION.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time: transition,
        observed_generation: generation,
    };
    match pos {
        Some(i) => conds[i] = c,
        None => conds.push(c),
    }
}

#[cfg(test)]
mod tests;
