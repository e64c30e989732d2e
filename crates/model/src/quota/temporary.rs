//! Temporary raises (`spec.temporary`): extra `hard` that holds until an RFC 3339 time, so a
//! launch week or an incident gets more GPUs without anyone remembering to take them back.
//!
//! The quota in force at `now` is `spec.hard` plus every raise not yet expired
//! ([`GpuQuotaSpec::in_force`]); deciders are handed that, so the check, batch and planning
//! arithmetic stay as they are. An expiry is a scheduled lowering of `hard`, with the meaning of
//! a user's edit: what runs keeps running, new admissions see the base. The controller keeps
//! each raise's state in the status ([`note_raises`]) and tells of an expiry once.

use super::crd::{
    GpuQuota, GpuQuotaSpec, GpuQuotaStatus, QuotaCondition, RaiseState, RaiseStatus, TemporaryRaise,
};
use super::status::set_condition;
use super::usage::{Amount, Dimension, Limits};
use crate::report::{truncate, MAX_NOTE_BYTES};
use k8s_openapi::jiff::Timestamp;

/// The GpuQuota condition telling whether raises are in force.
pub const RAISE_CONDITION: &str = "TemporaryRaise";

/// The condition's message is cut here: sixteen raises of sixty-four device kinds would
/// otherwise take tens of kilobytes of a status that must stay small.
const MAX_CONDITION_BYTES: usize = 2048;

impl TemporaryRaise {
    pub fn expiry(&self) -> Option<Timestamp> {
        self.expires.parse().ok()
    }

    pub fn state(&self, now: Timestamp) -> RaiseState {
        match self.expiry() {
            Some(t) if now < t => RaiseState::InForce,
            Some(_) => RaiseState::Expired,
            None => RaiseState::Invalid,
        }
    }

    /// `gpus +2, gpuMemory +80Gi`.
    fn amounts(&self) -> String {
        let parts: Vec<String> = self
            .hard
            .bounds()
            .into_iter()
            .map(|(d, a)| format!("{d} +{a}"))
            .collect();
        parts.join(", ")
    }
}

impl GpuQuotaSpec {
    /// The spec as it stands at `now`: `hard` raised by every raise in force, and no raises
    /// left (so applying it twice changes nothing). A raise of a dimension `hard` leaves
    /// unlimited adds nothing, and one whose sum would overflow is left out (fail closed).
    pub fn in_force(&self, now: Timestamp) -> GpuQuotaSpec {
        let mut spec = self.clone();
        spec.temporary.clear();
        for r in &self.temporary {
            if r.state(now) == RaiseState::InForce {
                if let Some(h) = raised(&spec.hard, &r.hard) {
                    spec.hard = h;
                }
            }
        }
        spec
    }

    /// The soonest expiry after `now`: the controller wakes then.
    pub fn next_expiry(&self, now: Timestamp) -> Option<Timestamp> {
        self.temporary
            .iter()
            .filter_map(TemporaryRaise::expiry)
            .filter(|t| *t > now)
            .min()
    }
}

impl GpuQuota {
    /// This quota with its spec in force at `now` ([`GpuQuotaSpec::in_force`]).
    pub fn in_force(mut self, now: Timestamp) -> GpuQuota {
        self.spec = self.spec.in_force(now);
        self
    }
}

/// `hard` with `extra` added in each dimension `hard` limits; None on overflow.
fn raised(hard: &Limits, extra: &Limits) -> Option<Limits> {
    let mut out = hard.clone();
    if let (Some(b), Some(a)) = (hard.gpus, extra.gpus) {
        out.gpus = Some(b.checked_add(a).ok()?);
    }
    if let (Some(b), Some(a)) = (hard.gpu_memory, extra.gpu_memory) {
        out.gpu_memory = Some(b.checked_add(a).ok()?);
    }
    for (k, a) in &extra.devices {
        if let Some(b) = hard.devices.get(k) {
            out.devices.insert(k.clone(), b.checked_add(*a)?);
        }
    }
    Some(out)
}

/// Brings `status.temporary` and the [`RAISE_CONDITION`] condition up to `now` for `spec`,
/// and returns one message per raise that expired since the controller last wrote its state
/// (each is told once, as an Event). A quota without raises has neither.
pub fn note_raises(
    spec: &GpuQuotaSpec,
    status: &mut GpuQuotaStatus,
    now: Timestamp,
    generation: Option<i64>,
) -> Vec<String> {
    let states: Vec<RaiseStatus> = spec
        .temporary
        .iter()
        .map(|r| RaiseStatus {
            reason: r.reason.clone(),
            expires: r.expires.clone(),
            state: r.state(now),
        })
        .collect();
    let was_in_force = |r: &RaiseStatus| {
        status.temporary.iter().any(|p| {
            p.reason == r.reason && p.expires == r.expires && p.state == RaiseState::InForce
        })
    };
    let base = spec.hard.bounds();
    let hard_now = spec.in_force(now).hard.bounds();
    let show = |b: &[(Dimension, Amount)]| {
        let parts: Vec<String> = b.iter().map(|(d, a)| format!("{d} {a}")).collect();
        parts.join(", ")
    };
    let mut expired_now = Vec::new();
    for (r, s) in spec.temporary.iter().zip(&states) {
        if s.state == RaiseState::Expired && was_in_force(s) {
            let told = format!(
                "temporary raise {} ({}) expired at {}: new admissions see {}",
                r.amounts(),
                r.reason,
                r.expires,
                show(&hard_now)
            );
            expired_now.push(truncate(told, MAX_NOTE_BYTES));
        }
    }
    status.temporary = states;
    let condition = raise_condition(spec, now, &show(&base), &show(&hard_now));
    let pos = status
        .conditions
        .iter()
        .position(|c| c.type_ == RAISE_CONDITION);
    match (condition, pos) {
        (None, Some(i)) => {
            status.conditions.remove(i);
        }
        (None, None) => {}
        (Some((state, reason, message)), _) => {
            let c = QuotaCondition {
                type_: RAISE_CONDITION.into(),
                status: state.into(),
                reason: reason.into(),
                message,
                last_transition_time: String::new(),
                observed_generation: generation,
            };
            set_condition(&mut status.conditions, c, now);
        }
    }
    expired_now
}

/// The condition's status, reason and message; None without raises.
fn raise_condition(
    spec: &GpuQuotaSpec,
    now: Timestamp,
    base: &str,
    hard_now: &str,
) -> Option<(&'static str, &'static str, String)> {
    let of = |want: RaiseState| -> Vec<&TemporaryRaise> {
        spec.temporary
            .iter()
            .filter(|r| r.state(now) == want)
            .collect()
    };
    let (in_force, invalid) = (of(RaiseState::InForce), of(RaiseState::Invalid));
    let mut parts = Vec::new();
    if !in_force.is_empty() {
        let each: Vec<String> = in_force
            .iter()
            .map(|r| format!("{} until {} ({})", r.amounts(), r.expires, r.reason))
            .collect();
        parts.push(format!(
            "in force: {}; hard now {hard_now}",
            each.join("; ")
        ));
    }
    for r in &invalid {
        parts.push(format!(
            "raise ({}) is ignored: expires `{}` is not an RFC 3339 time; fix it in spec.temporary",
            r.reason, r.expires
        ));
    }
    if spec.temporary.is_empty() {
        return None;
    }
    if in_force.is_empty() {
        parts.insert(0, format!("no raise in force; hard is spec.hard ({base})"));
        let reason = if invalid.is_empty() {
            "Expired"
        } else {
            "Invalid"
        };
        return Some((
            "False",
            reason,
            truncate(parts.join("; "), MAX_CONDITION_BYTES),
        ));
    }
    Some((
        "True",
        "InForce",
        truncate(parts.join("; "), MAX_CONDITION_BYTES),
    ))
}
