//! The quota model as the planner's [`Ledger`] (pure): every fit question goes to
//! [`crate::quota::check()`], every sum to the model's `Usage`; nothing here re-implements quota
//! arithmetic.
//!
//! For planning, each GpuQuota is *compacted*: its `status.used` becomes everything it holds
//! (used plus `Reserved` reservations, less those of the pods being planned, which are
//! re-decided) and its reservation list is emptied, so a check costs the same with ten
//! reservations or ten thousand, and admitting a unit is one addition.

use super::plan::Ledger;
use crate::quota::{check, Charge, GpuQuota, QuotaMathError, ReservationKey, Usage};
use k8s_openapi::jiff::Timestamp;
use std::collections::{BTreeMap, BTreeSet};

/// `quota` with `used` = everything it holds (used, escrows, `Reserved` reservations) except
/// the reservations in `exclude`, no reservation or escrow list, and the spec in force at `now` (temporary raises folded into `hard`).
pub fn compact(
    quota: &GpuQuota,
    exclude: &BTreeSet<ReservationKey>,
    now: Timestamp,
) -> Result<GpuQuota, QuotaMathError> {
    let mut status = quota.status_or_default();
    status.reservations.retain(|r| !exclude.contains(&r.key()));
    let held = status.consumed(None)?;
    let mut out = quota.clone();
    out.spec = quota.spec.in_force(now);
    let mut s = status;
    s.used = held;
    s.reservations.clear();
    // `held` has the escrows in it: kept, `consumed` would count them twice.
    s.escrows.clear();
    s.recompute_totals()?;
    out.status = Some(s);
    Ok(out)
}

/// Every quota of the cluster, compacted, as the cycle admits into them.
#[derive(Debug, Clone, Default)]
pub struct Working {
    quotas: Vec<GpuQuota>,
    /// The same quotas with nothing held: what could ever fit.
    empty: Vec<GpuQuota>,
    by_namespace: BTreeMap<String, Vec<usize>>,
}

fn emptied(q: &GpuQuota) -> GpuQuota {
    let mut e = q.clone();
    e.status = None;
    e
}

impl Working {
    /// From compacted quotas.
    pub fn new(quotas: Vec<GpuQuota>) -> Working {
        let mut w = Working::default();
        for q in quotas {
            w.put(q);
        }
        w
    }

    /// Adds `quota` (compacted), replacing the one with the same namespace and name.
    pub fn put(&mut self, quota: GpuQuota) {
        let id = quota.id();
        match self.quotas.iter().position(|q| q.id() == id) {
            Some(i) => {
                self.empty[i] = emptied(&quota);
                self.quotas[i] = quota;
            }
            None => {
                let ns = quota.metadata.namespace.clone().unwrap_or_default();
                self.by_namespace
                    .entry(ns)
                    .or_default()
                    .push(self.quotas.len());
                self.empty.push(emptied(&quota));
                self.quotas.push(quota);
            }
        }
    }

    /// The ledger of one namespace: a unit must fit every GpuQuota of its namespace.
    pub fn namespace(&mut self, namespace: &str) -> NamespaceLedger<'_> {
        let idx = self.at(namespace).to_vec();
        NamespaceLedger { working: self, idx }
    }

    pub fn quotas(&self) -> &[GpuQuota] {
        &self.quotas
    }

    /// The quotas of `namespace`.
    pub fn quotas_in<'a>(&'a self, namespace: &str) -> impl Iterator<Item = &'a GpuQuota> + 'a {
        self.at(namespace).iter().map(|&i| &self.quotas[i])
    }

    /// `Ok` when `charge` fits every quota of `namespace` now; else why, with the numbers.
    pub fn fits(&self, namespace: &str, charge: &Charge) -> Result<(), String> {
        self.check_at(self.at(namespace), charge)
    }

    /// `Ok` when `charge` could fit every quota of `namespace` if nothing were held; else why.
    pub fn within_limits(&self, namespace: &str, charge: &Charge) -> Result<(), String> {
        self.within_limits_at(self.at(namespace), charge)
    }

    /// Takes `usage` out of what every quota of `namespace` holds (a pod that will be gone),
    /// floored at zero: what would fit without it. [`Working::hold`] puts it back.
    pub fn release(&mut self, namespace: &str, usage: &Usage) -> Result<(), QuotaMathError> {
        let idx = self.by_namespace.get(namespace).map(Vec::as_slice);
        for &i in idx.unwrap_or_default() {
            let q = &mut self.quotas[i];
            let mut s = q.status_or_default();
            s.used = s.used.saturating_sub(usage)?;
            q.status = Some(s);
        }
        Ok(())
    }

    /// Counts `usage` as held by every quota of `namespace`.
    pub fn hold(&mut self, namespace: &str, usage: &Usage) -> Result<(), QuotaMathError> {
        let idx = self.by_namespace.get(namespace).map(Vec::as_slice);
        hold_at(&mut self.quotas, idx.unwrap_or_default(), usage)
    }

    fn at(&self, namespace: &str) -> &[usize] {
        self.by_namespace
            .get(namespace)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    fn check_at(&self, idx: &[usize], charge: &Charge) -> Result<(), String> {
        let why: Vec<String> = idx
            .iter()
            .filter_map(|&i| {
                check(&self.quotas[i], &self.quotas, None, charge)
                    .err()
                    .map(|d| d.to_string())
            })
            .collect();
        if why.is_empty() {
            Ok(())
        } else {
            Err(why.join("; "))
        }
    }

    fn within_limits_at(&self, idx: &[usize], charge: &Charge) -> Result<(), String> {
        for &i in idx {
            if let Err(d) = check(&self.empty[i], &self.empty, None, charge) {
                return Err(format!("{d}, even with nothing else admitted"));
            }
        }
        Ok(())
    }
}

/// Adds `usage` to every quota at `idx`; on an overflow each quota keeps what could be added
/// (the full side) and the error is returned after all were tried.
fn hold_at(quotas: &mut [GpuQuota], idx: &[usize], usage: &Usage) -> Result<(), QuotaMathError> {
    let mut out = Ok(());
    for &i in idx {
        let q = &mut quotas[i];
        let mut s = q.status_or_default();
        if let Err(e) = s.used.add_assign(usage) {
            out = Err(e);
        }
        q.status = Some(s);
    }
    out
}

/// One namespace's view of [`Working`].
pub struct NamespaceLedger<'a> {
    working: &'a mut Working,
    idx: Vec<usize>,
}

impl Ledger for NamespaceLedger<'_> {
    type Charge = Charge;

    fn check(&self, charge: &Charge) -> Result<(), String> {
        self.working.check_at(&self.idx, charge)
    }

    fn within_limits(&self, charge: &Charge) -> Result<(), String> {
        self.working.within_limits_at(&self.idx, charge)
    }

    fn admit(&mut self, charge: &Charge) {
        if let Err(e) = hold_at(&mut self.working.quotas, &self.idx, &charge.usage) {
            // Cannot happen after a successful check (it summed the same numbers); the quota
            // keeps what it could add, which errs on the full side.
            tracing::warn!(error = %e, "admitting into the working ledger");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::{
        GpuQuotaSpec, GpuQuotaStatus, Gpus, Limits, ObjectKind, Reservation, ReservationState,
        Usage,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn quota(ns: &str, hard_gpus: u64, used: u64) -> GpuQuota {
        GpuQuota {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some("default".into()),
                ..ObjectMeta::default()
            },
            spec: GpuQuotaSpec {
                hard: Limits {
                    gpus: Some(Gpus::whole(hard_gpus)),
                    ..Limits::default()
                },
                ..GpuQuotaSpec::default()
            },
            status: Some(GpuQuotaStatus {
                used: Usage {
                    gpus: Gpus::whole(used),
                    ..Usage::default()
                },
                ..GpuQuotaStatus::default()
            }),
        }
    }

    fn reservation(name: &str, state: ReservationState, n: u64) -> Reservation {
        Reservation {
            kind: ObjectKind::Pod,
            namespace: "team-a".into(),
            name: name.into(),
            uid: None,
            state,
            charge: Charge::whole_gpus(n).usage,
            unpriced: Vec::new(),
            priority: None,
            since: "2025-01-01T00:00:00Z".into(),
        }
    }

    #[test]
    fn the_ledger_says_what_is_missing_with_the_numbers() {
        let mut w = Working::new(vec![compact(
            &quota("team-a", 8, 6),
            &BTreeSet::new(),
            Timestamp::UNIX_EPOCH,
        )
        .unwrap()]);
        let mut l = w.namespace("team-a");
        assert_eq!(
            l.check(&Charge::whole_gpus(4)),
            Err("gpus: requested 4, used 6 of 8 in GpuQuota team-a/default".into())
        );
        assert!(l.check(&Charge::whole_gpus(2)).is_ok());
        l.admit(&Charge::whole_gpus(2));
        assert_eq!(
            l.check(&Charge::whole_gpus(1)),
            Err("gpus: requested 1, used 8 of 8 in GpuQuota team-a/default".into())
        );
        assert!(l.within_limits(&Charge::whole_gpus(8)).is_ok());
        assert_eq!(
            l.within_limits(&Charge::whole_gpus(9)),
            Err("gpus: requested 9, used 0 of 8 in GpuQuota team-a/default, even with nothing else admitted".into())
        );
        // A namespace without a quota is not limited.
        assert!(w
            .namespace("team-b")
            .check(&Charge::whole_gpus(100))
            .is_ok());
    }

    #[test]
    fn compaction_counts_reserved_reservations_except_those_being_replanned() {
        let mut q = quota("team-a", 8, 1);
        if let Some(s) = q.status.as_mut() {
            s.reservations = vec![
                reservation("a", ReservationState::Reserved, 2),
                reservation("b", ReservationState::Reserved, 3),
                reservation("c", ReservationState::Queued, 4),
            ];
        }
        let replanned: BTreeSet<_> = [ReservationKey::pod("team-a", "b")].into();
        let c = compact(&q, &replanned, Timestamp::UNIX_EPOCH).unwrap();
        let s = c.status.unwrap();
        assert_eq!(s.used.gpus, Gpus::whole(3));
        assert!(s.reservations.is_empty());
    }

    #[test]
    fn compaction_counts_an_escrow_once() {
        let mut q = quota("team-a", 8, 1);
        if let Some(s) = q.status.as_mut() {
            s.escrows = vec![crate::quota::Escrow {
                holder: "replica-1".into(),
                amount: Charge::whole_gpus(2).usage,
                renewed: "2025-01-01T00:00:00Z".into(),
            }];
        }
        let c = compact(&q, &BTreeSet::new(), Timestamp::UNIX_EPOCH).unwrap();
        let held = c.status_or_default().consumed(None).unwrap();
        assert_eq!(held.gpus, Gpus::whole(3));
        // 5 of 8 are free, not 3.
        let mut w = Working::new(vec![c]);
        assert!(w.namespace("team-a").check(&Charge::whole_gpus(5)).is_ok());
    }
}
