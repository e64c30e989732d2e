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

mod preemptions;
mod units;

use super::hours::Book;
use super::plan::plan_releases;
use super::pods::{self, PodRef};
use super::quota_ledger::{compact, Working};
use crate::controller::preempt::Candidate;
use crate::quota::clock::rfc3339;
use crate::quota::escrow::{stale_escrows, MAX_UNFLUSHED};
use crate::quota::status::set_condition;
use crate::quota::{
    claim_charge, claim_is_pod_owned, note_raises, pod_charge, settled_claim_charge,
    stale_reservations, Charge, DeviceCatalog, GpuQuota, LiveObject, ObjectKind, QuotaCondition,
    QuotaMathError, QuotaMode, Reservation, ReservationKey, ReservationState, Usage,
    MAX_RESERVATIONS,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimSpec};
use k8s_openapi::jiff::Timestamp;
pub use preemptions::{Eviction, MAX_PREEMPTORS, PREEMPTING};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use units::{build_units, notes};

/// The GpuQuota condition the controller keeps on Queue-mode quotas.
pub const QUEUE_CONDITION: &str = "QueueWaiting";

/// Tunables of the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSettings {
    /// The starvation bound (see `plan.rs`).
    pub bound: Duration,
    /// How long a reservation may wait for its object ([`stale_reservations`]).
    pub grace: Duration,
    /// Kueue runs in the cluster: the pods it governs ([`crate::kueue::managed`]) are not
    /// charged, queued or preempted here, and the quotas say so in a condition.
    pub kueue: bool,
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings {
            bound: Duration::from_secs(120),
            grace: crate::quota::DEFAULT_RESERVATION_GRACE,
            kueue: false,
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
    /// The GPU-hours book, whose current period's totals each quota's status shows.
    pub hours: Option<&'a Book>,
    /// The pods a waiting unit of this namespace may have evicted, with their charges: those
    /// counted in its quotas and in the quotas of its cohorts (empty when no quota of the
    /// namespace preempts).
    pub candidates: &'a [Candidate],
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
    /// When the plan may change by time alone (a bound, a reservation grace or a temporary
    /// raise running out).
    pub next_deadline: Option<SystemTime>,
    /// Events to record on quotas once their status is written: (quota name, reason,
    /// message), e.g. a temporary raise that expired.
    pub quota_events: Vec<(String, &'static str, String)>,
    /// Pods to evict so that waiting units fit (`spec.preemption`).
    pub evictions: Vec<Eviction>,
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
    /// The namespace's GPU pods Kueue governs, left to it.
    kueue: crate::kueue::Governed,
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
    let mut kueue = crate::kueue::Governed::default();
    for p in input.pods {
        let name = p.metadata.name.clone().unwrap_or_default();
        if input.settings.kueue && kueue.take(p) {
            continue;
        }
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
    count_claims(input, &mut used, &mut live)?;
    let gated = input
        .pods
        .iter()
        .filter(|p| {
            pods::is_queued(p) && !(input.settings.kueue && crate::kueue::managed(p).is_some())
        })
        .map(|p| Queued {
            pod: p,
            key: ReservationKey::pod(ns, p.metadata.name.as_deref().unwrap_or_default()),
            charge: charge_of(p),
        })
        .collect();
    charges.by_namespace.insert(ns.to_string(), kept);
    Ok(Observed {
        used,
        live,
        gated,
        kueue,
    })
}

/// Adds the namespace's standalone claims (those allocated, at their settled charge) to `used`
/// and every standalone claim to `live`.
fn count_claims(
    input: &Inputs<'_>,
    used: &mut Usage,
    live: &mut BTreeMap<ReservationKey, LiveObject>,
) -> Result<(), QuotaMathError> {
    let ns = input.namespace;
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
    Ok(())
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

    // Drop what is counted or stale.
    let mut quotas: Vec<GpuQuota> = fresh.to_vec();
    let mut next_deadline: Option<SystemTime> = None;
    for q in &mut quotas {
        refresh_status(
            q,
            observed,
            now_ts,
            input.settings.grace,
            &mut next_deadline,
        )?;
    }

    // The queue.
    let (admitted_gated, queued) = split_admitted(&quotas, &observed.gated);
    let exclude: BTreeSet<ReservationKey> = queued.iter().map(|q| q.key.clone()).collect();
    for q in &quotas {
        working.put(compact(q, &exclude, now_ts)?);
        if let Some(t) = q.spec.next_expiry(now_ts) {
            // A raise ends: the plan may change then.
            earliest(&mut next_deadline, SystemTime::from(t));
        }
    }
    let (units, members, mut waiting) = build_units(input, &queued)?;
    // The ledger before the plan, for taking back what preempting units need (only when
    // preemption may happen: the copy holds every quota of the cluster).
    let before = (!input.candidates.is_empty()).then(|| working.clone());
    let mut plan = plan_releases(
        &units,
        &mut working.namespace(ns),
        input.now,
        input.settings.bound,
    );
    if let Some(d) = plan.next_deadline {
        earliest(&mut next_deadline, d);
    }
    let parts = (&units[..], &members[..], &queued[..]);
    let choice = match before {
        Some(before) => preemptions::preempt(input, parts, &mut plan, before, working)?,
        None => preemptions::Choice::default(),
    };

    let releases = record_admissions(&plan, &members, &queued, &mut quotas, now_ts);
    waiting.extend(notes(input, &units, &members, &queued, &plan));
    preemptions::tell(&choice, parts, &mut waiting);
    let evictions = choice.evictions;

    let head = plan
        .waits
        .first()
        .map(|w| format!("; first: {} ({})", units[w.index].key, w.reason.kind()));
    let mut quota_events = Vec::new();
    let quotas = finish_statuses(
        quotas,
        fresh,
        (waiting.len(), head),
        &observed.kueue,
        input.hours,
        now_ts,
        &mut quota_events,
    )?;
    Ok(Decision {
        quotas,
        quota_events,
        releases,
        admitted_gated,
        waiting,
        next_deadline,
        evictions,
    })
}

/// Records the plan's releases as `Reserved` in every quota and returns them, unit by unit;
/// what does not fit in the reservation lists waits for the next cycle (their entries are
/// dropped as the released pods are seen counted).
fn record_admissions(
    plan: &crate::controller::plan::Plan,
    members: &[Vec<usize>],
    queued: &[Queued<'_>],
    quotas: &mut [GpuQuota],
    now: Timestamp,
) -> Vec<Vec<PodRef>> {
    let mut releases = Vec::new();
    let mut admitted: Vec<&Queued<'_>> = Vec::new();
    let room = admission_room(quotas);
    for r in &plan.releases {
        if admitted.len() + members[r.index].len() > room {
            break;
        }
        releases.push(
            members[r.index]
                .iter()
                .map(|&i| PodRef::of(queued[i].pod))
                .collect(),
        );
        admitted.extend(members[r.index].iter().map(|&i| &queued[i]));
    }
    if !admitted.is_empty() {
        for q in quotas.iter_mut() {
            let mut s = q.status_or_default();
            admit(&mut s, &admitted, now);
            q.status = Some(s);
        }
    }
    releases
}

/// Moves `next` to `at` when that is sooner.
fn earliest(next: &mut Option<SystemTime>, at: SystemTime) {
    *next = Some(next.map_or(at, |d| d.min(at)));
}

/// Sets a quota's usage to what was observed and drops the reservations of counted objects,
/// stale reservations and dead escrows; `next_deadline` moves to the soonest grace end left.
fn refresh_status(
    q: &mut GpuQuota,
    observed: &Observed<'_>,
    now_ts: Timestamp,
    grace: Duration,
    next_deadline: &mut Option<SystemTime>,
) -> Result<(), QuotaMathError> {
    let live = &observed.live;
    let mut s = q.status_or_default();
    s.used = observed.used.clone();
    let stale: BTreeSet<ReservationKey> = stale_reservations(&s, live, now_ts, grace)
        .into_iter()
        .collect();
    if !stale.is_empty() {
        s.reservations.retain(|r| !stale.contains(&r.key()));
    }
    // An escrow its holder stopped renewing (the replica died): what it admitted exists
    // as pods by now.
    let dead = stale_escrows(&s, now_ts, grace);
    s.escrows.retain(|e| !dead.contains(&e.holder));
    for e in &s.escrows {
        if let Ok(t) = e.renewed.parse::<Timestamp>() {
            earliest(next_deadline, SystemTime::from(t) + grace);
        }
    }
    // A reservation without its object is dropped when its grace ends: wake up then.
    for r in &s.reservations {
        if !live.contains_key(&r.key()) {
            if let Some(t) = r.since_time() {
                earliest(next_deadline, SystemTime::from(t) + grace);
            }
        }
    }
    s.recompute_totals()?;
    q.status = Some(s);
    Ok(())
}

/// Splits the gated pods into those already `Reserved` in every quota (admitted earlier:
/// ungate without planning) and those still queued.
fn split_admitted<'a>(quotas: &[GpuQuota], gated: &[Queued<'a>]) -> (Vec<PodRef>, Vec<Queued<'a>>) {
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
    let mut admitted_gated = Vec::new();
    let mut queued: Vec<Queued<'_>> = Vec::new();
    for g in gated {
        if reserved_everywhere(&g.key) {
            admitted_gated.push(PodRef::of(g.pod));
        } else {
            queued.push(g.clone());
        }
    }
    (admitted_gated, queued)
}

/// The quotas as they should be written: totals recomputed, the observed generation, the
/// queue condition on Queue-mode quotas (`waiting`: how many pods wait, and the head's note),
/// the ledger's totals, the state of temporary raises (an Event in `events` for each that just
/// expired); each with whether it differs from `fresh`.
fn finish_statuses(
    quotas: Vec<GpuQuota>,
    fresh: &[GpuQuota],
    (waiting_pods, head): (usize, Option<String>),
    kueue: &crate::kueue::Governed,
    hours: Option<&Book>,
    now_ts: Timestamp,
    events: &mut Vec<(String, &'static str, String)>,
) -> Result<Vec<(GpuQuota, bool)>, QuotaMathError> {
    let mut out = Vec::new();
    for (q, f) in quotas.into_iter().zip(fresh) {
        let mut q = q;
        let mut s = q.status_or_default();
        s.recompute_totals()?;
        s.observed_generation = q.metadata.generation;
        let name = q.metadata.name.clone().unwrap_or_default();
        for message in note_raises(&q.spec, &mut s, now_ts, q.metadata.generation) {
            events.push((name.clone(), "TemporaryRaiseExpired", message));
        }
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
            let c = QuotaCondition {
                type_: QUEUE_CONDITION.into(),
                status: status.into(),
                reason: reason.into(),
                message,
                last_transition_time: String::new(),
                observed_generation: q.metadata.generation,
            };
            set_condition(&mut s.conditions, c, now_ts);
        }
        if let Some(message) = kueue.condition(&mut s.conditions, q.metadata.generation, now_ts) {
            events.push((name.clone(), crate::kueue::SHARED_EVENT, message));
        }
        if let Some(book) = hours {
            s.gpu_hours = book.quota_status(&q).or(s.gpu_hours);
        }
        q.status = Some(s);
        let changed = q.status != f.status;
        out.push((q, changed));
    }
    Ok(out)
}

/// How many pods may be admitted this cycle: the fewest any quota of the namespace can record
/// as `Reserved` within [`MAX_RESERVATIONS`] (its `Queued` entries may give way, see [`admit`];
/// each escrow keeps room for its flush).
fn admission_room(quotas: &[GpuQuota]) -> usize {
    quotas
        .iter()
        .map(|q| {
            let s = q.status.as_ref();
            let reserved = s.map_or(0, |s| {
                s.reservations
                    .iter()
                    .filter(|r| r.state == ReservationState::Reserved)
                    .count()
            });
            let kept = s.map_or(0, kept);
            MAX_RESERVATIONS.saturating_sub(reserved.saturating_add(kept))
        })
        .min()
        .unwrap_or(MAX_RESERVATIONS)
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
    // Queued entries are optional (the gate holds their pods): the newest give way to
    // keep the list within its bound.
    while s.reservations.len() + kept(s) > MAX_RESERVATIONS {
        let Some(i) = s
            .reservations
            .iter()
            .rposition(|r| r.state == ReservationState::Queued)
        else {
            break;
        };
        s.reservations.remove(i);
    }
}

fn kept(s: &crate::quota::GpuQuotaStatus) -> usize {
    s.escrows.len().saturating_mul(MAX_UNFLUSHED)
}

#[cfg(test)]
mod tests;
