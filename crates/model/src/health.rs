//! Device health bookkeeping (pure): which units are unhealthy, why, and when they recover.
//!
//! A unit is a whole GPU or one MIG device, by UUID. An Xid on a GPU marks the GPU and, through
//! the parent link, all its MIG devices; an Xid attributed to one MIG device marks only that one.
//! Xid-marked units recover after a quiet period without critical Xids; a lost GPU recovers when
//! it answers the driver again. The caller supplies the clock, so tests need no sleeping.

use crate::config::XidPolicy;
use crate::inventory::{DeviceUuid, Inventory};
use crate::source::DeviceEvent;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Xid 79: "GPU has fallen off the bus".
pub const XID_FALLEN_OFF_BUS: u64 = 79;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy(Cause),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// A critical Xid, the last one seen.
    Xid(u64),
    /// The GPU stopped answering the driver.
    Lost,
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::Xid(x) => write!(f, "critical Xid {x}"),
            Cause::Lost => f.write_str("GPU lost (not answering the driver)"),
        }
    }
}

#[derive(Debug, Clone)]
struct Mark {
    cause: Cause,
    since: Instant,
}

/// What a call changed, for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Unhealthy {
        unit: DeviceUuid,
        cause: Cause,
    },
    Recovered {
        unit: DeviceUuid,
        after: Cause,
    },
    /// A non-critical Xid, ignored by policy.
    Ignored {
        unit: DeviceUuid,
        xid: u64,
    },
}

#[derive(Debug, Clone, Default)]
pub struct HealthBook {
    marks: BTreeMap<DeviceUuid, Mark>,
    parent: BTreeMap<DeviceUuid, DeviceUuid>,
    /// Every unit of the inventory.
    units: std::collections::BTreeSet<DeviceUuid>,
}

impl HealthBook {
    /// Learns which MIG device belongs to which GPU; marks of units that vanished are dropped.
    pub fn set_inventory(&mut self, inv: &Inventory) {
        self.parent = inv
            .gpus
            .iter()
            .flat_map(|g| {
                g.mig_devices
                    .iter()
                    .map(move |m| (m.uuid.clone(), g.uuid.clone()))
            })
            .collect();
        self.units = inv
            .gpus
            .iter()
            .flat_map(|g| {
                std::iter::once(g.uuid.clone()).chain(g.mig_devices.iter().map(|m| m.uuid.clone()))
            })
            .collect();
        let units = &self.units;
        self.marks.retain(|unit, _| units.contains(unit));
    }

    /// Health of a unit, taking its parent GPU into account.
    pub fn health(&self, unit: &str) -> Health {
        let own = self.marks.get(unit);
        let parent = self.parent.get(unit).and_then(|p| self.marks.get(p));
        match own.or(parent) {
            Some(m) => Health::Unhealthy(m.cause),
            None => Health::Healthy,
        }
    }

    fn mark(&mut self, unit: &DeviceUuid, cause: Cause, now: Instant) -> Change {
        // A lost GPU stays lost until it answers again, whatever Xids follow.
        let cause = match self.marks.get(unit) {
            Some(Mark {
                cause: Cause::Lost, ..
            }) => Cause::Lost,
            _ => cause,
        };
        self.marks.insert(unit.clone(), Mark { cause, since: now });
        Change::Unhealthy {
            unit: unit.clone(),
            cause,
        }
    }

    /// Applies a driver event.
    pub fn on_event(&mut self, event: &DeviceEvent, now: Instant, policy: &XidPolicy) -> Change {
        let DeviceEvent::Xid {
            gpu_uuid,
            mig_uuid,
            xid,
        } = event;
        let unit = mig_uuid.as_ref().unwrap_or(gpu_uuid);
        if *xid == XID_FALLEN_OFF_BUS {
            return self.mark(gpu_uuid, Cause::Lost, now);
        }
        if !policy.is_critical(*xid) {
            return Change::Ignored {
                unit: unit.clone(),
                xid: *xid,
            };
        }
        self.mark(unit, Cause::Xid(*xid), now)
    }

    /// Marks a GPU lost (discovery could not reach it).
    pub fn on_lost(&mut self, gpu_uuid: &DeviceUuid, now: Instant) -> Change {
        self.mark(gpu_uuid, Cause::Lost, now)
    }

    /// Recovers Xid-marked units whose last critical Xid is older than `quiet`.
    pub fn expire_xids(&mut self, now: Instant, quiet: Duration) -> Vec<Change> {
        self.tick(now, quiet, |_| false)
    }

    /// The GPUs marked lost, to ask the driver about (off the state lock: the query may hang).
    pub fn lost(&self) -> Vec<DeviceUuid> {
        self.marks
            .iter()
            .filter(|(_, m)| m.cause == Cause::Lost)
            .map(|(u, _)| u.clone())
            .collect()
    }

    /// Recovers the lost GPUs in `answered`, which answered a probe started at `asked_at`. A GPU
    /// marked lost again after that (a newer Xid 79) keeps its mark: the answer predates it. A
    /// GPU no longer in the inventory has no mark, so an answer for it changes nothing.
    pub fn recover_answered(&mut self, answered: &[DeviceUuid], asked_at: Instant) -> Vec<Change> {
        let mut out = Vec::new();
        for unit in answered {
            let Some(m) = self.marks.get(unit) else {
                continue;
            };
            if m.cause != Cause::Lost || m.since > asked_at {
                continue;
            }
            self.marks.remove(unit);
            out.push(Change::Recovered {
                unit: unit.clone(),
                after: Cause::Lost,
            });
        }
        out
    }

    /// Recovers units: Xid marks older than `quiet`, lost GPUs that `responds` again.
    pub fn tick(
        &mut self,
        now: Instant,
        quiet: Duration,
        responds: impl Fn(&str) -> bool,
    ) -> Vec<Change> {
        let mut out = Vec::new();
        self.marks.retain(|unit, m| {
            let recovered = match m.cause {
                Cause::Xid(_) => now.saturating_duration_since(m.since) >= quiet,
                Cause::Lost => responds(unit),
            };
            if recovered {
                out.push(Change::Recovered {
                    unit: unit.clone(),
                    after: m.cause,
                });
            }
            !recovered
        });
        out
    }

    /// Every unhealthy unit (own marks only) with its cause.
    pub fn unhealthy(&self) -> impl Iterator<Item = (&str, Cause)> {
        self.marks.iter().map(|(u, m)| (u.as_str(), m.cause))
    }

    /// The Xid marks as they outlive the agent: each with the wall-clock time of its last
    /// critical Xid, `now` being `now_unix_ms` there. Lost marks are not kept: the next
    /// discovery finds a GPU that still does not answer.
    pub fn saved_marks(&self, now: Instant, now_unix_ms: u64) -> Vec<SavedMark> {
        self.marks
            .iter()
            .filter_map(|(unit, m)| match m.cause {
                Cause::Xid(xid) => {
                    let age = u64::try_from(now.saturating_duration_since(m.since).as_millis())
                        .unwrap_or(u64::MAX);
                    Some(SavedMark {
                        unit: unit.to_string(),
                        xid,
                        at_unix_ms: now_unix_ms.saturating_sub(age),
                    })
                }
                Cause::Lost => None,
            })
            .collect()
    }

    /// Restores saved Xid marks of units in the inventory (call after [`Self::set_inventory`]),
    /// each as old as the wall clock says, so the quiet period runs on from where the last
    /// agent left it; a mark whose quiet period has passed is dropped, one dated in the future
    /// (a clock step) counts as made now. Returns the units marked.
    pub fn restore(
        &mut self,
        saved: &[SavedMark],
        now: Instant,
        now_unix_ms: u64,
        quiet: Duration,
    ) -> Vec<DeviceUuid> {
        let mut marked = Vec::new();
        for m in saved {
            let age = Duration::from_millis(now_unix_ms.saturating_sub(m.at_unix_ms));
            let Some(unit) = self.units.get(m.unit.as_str()).cloned() else {
                continue;
            };
            if age >= quiet {
                continue;
            }
            let since = now.checked_sub(age).unwrap_or(now);
            self.marks.insert(
                unit.clone(),
                Mark {
                    cause: Cause::Xid(m.xid),
                    since,
                },
            );
            marked.push(unit);
        }
        marked
    }
}

/// An Xid mark kept across agent restarts ([`HealthBook::saved_marks`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SavedMark {
    /// The unit's UUID (GPU or MIG device).
    pub unit: String,
    /// The last critical Xid.
    pub xid: u64,
    /// When it came, Unix milliseconds.
    pub at_unix_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::DeviceUuid;

    #[test]
    fn xid_marks_outlive_the_agent_with_their_age_and_expire_on_time() {
        let (mut book, inv, policy) = setup();
        let t0 = Instant::now();
        let gpu = inv.gpus[3].uuid.clone();
        book.on_event(&xid(&gpu, None, 48), t0, &policy);
        book.on_lost(&inv.gpus[1].uuid, t0);
        // Saved 60 s after the Xid, at wall-clock 1_060_000 ms: the Xid came at 1_000_000.
        let saved = book.saved_marks(t0 + Duration::from_secs(60), 1_060_000);
        assert_eq!(
            saved,
            vec![SavedMark {
                unit: gpu.to_string(),
                xid: 48,
                at_unix_ms: 1_000_000
            }]
        );
        // A new agent, 30 s of wall clock later, quiet period 5 min: still unhealthy, and it
        // recovers 5 min after the Xid, not 5 min after the restart.
        let mut next = HealthBook::default();
        next.set_inventory(&inv);
        // Later than t0 on the monotonic clock, far enough to subtract any age from.
        let t1 = t0 + Duration::from_secs(3600);
        let quiet = Duration::from_secs(300);
        assert_eq!(
            next.restore(&saved, t1, 1_090_000, quiet),
            vec![gpu.clone()]
        );
        assert_eq!(next.health(gpu.as_str()), Health::Unhealthy(Cause::Xid(48)));
        assert!(next
            .expire_xids(t1 + Duration::from_secs(209), quiet)
            .is_empty());
        assert_eq!(
            next.expire_xids(t1 + Duration::from_secs(211), quiet).len(),
            1
        );
        // Past its quiet period, or of a unit no longer there, or from the future.
        let mut late = HealthBook::default();
        late.set_inventory(&inv);
        assert!(late.restore(&saved, t1, 1_300_001, quiet).is_empty());
        let gone = SavedMark {
            unit: "GPU-gone".into(),
            ..saved[0].clone()
        };
        assert!(late.restore(&[gone], t1, 1_000_001, quiet).is_empty());
        assert_eq!(late.restore(&saved, t1, 900_000, quiet), vec![gpu.clone()]);
        assert!(late
            .expire_xids(t1 + Duration::from_secs(299), quiet)
            .is_empty());
    }

    fn setup() -> (HealthBook, Inventory, XidPolicy) {
        let inv = crate::sim::load("a100-mig-mixed").unwrap();
        let mut book = HealthBook::default();
        book.set_inventory(&inv);
        (book, inv, crate::config::AgentConfig::default().xid_policy)
    }

    fn xid(gpu: &str, mig: Option<&str>, xid: u64) -> DeviceEvent {
        DeviceEvent::Xid {
            gpu_uuid: DeviceUuid::parse(gpu).unwrap(),
            mig_uuid: mig.map(|m| DeviceUuid::parse(m).unwrap()),
            xid,
        }
    }

    #[test]
    fn a_probe_answer_recovers_only_marks_older_than_the_probe() {
        let (mut book, inv, _) = setup();
        let (a, b) = (inv.gpus[0].uuid.clone(), inv.gpus[1].uuid.clone());
        let t0 = Instant::now();
        book.on_lost(&a, t0);
        book.on_lost(&b, t0);
        assert_eq!(book.lost(), {
            let mut v = vec![a.clone(), b.clone()];
            v.sort();
            v
        });
        let asked = t0 + Duration::from_secs(1);
        // B fell off the bus again while the probe ran: its answer is older than the mark.
        book.on_lost(&b, asked + Duration::from_millis(1));
        let gone = DeviceUuid::parse("GPU-gone").unwrap();
        let rec = book.recover_answered(&[a.clone(), b.clone(), gone], asked);
        assert_eq!(
            rec,
            vec![Change::Recovered {
                unit: a.clone(),
                after: Cause::Lost
            }]
        );
        assert_eq!(book.health(&a), Health::Healthy);
        assert_eq!(book.health(&b), Health::Unhealthy(Cause::Lost));
        // Xid expiry never touches a lost GPU.
        assert!(book
            .expire_xids(asked + Duration::from_secs(3600), Duration::ZERO)
            .is_empty());
    }

    #[test]
    fn a_gpu_xid_marks_the_gpu_and_its_mig_devices_and_recovers_after_the_quiet_period() {
        let (mut book, inv, policy) = setup();
        let t0 = Instant::now();
        let gpu = &inv.gpus[0];
        book.on_event(&xid(&gpu.uuid, None, 48), t0, &policy);
        assert_eq!(book.health(&gpu.uuid), Health::Unhealthy(Cause::Xid(48)));
        assert_eq!(
            book.health(&gpu.mig_devices[2].uuid),
            Health::Unhealthy(Cause::Xid(48))
        );
        assert_eq!(book.health(&inv.gpus[1].uuid), Health::Healthy);
        assert!(book
            .tick(
                t0 + Duration::from_secs(10),
                Duration::from_secs(60),
                |_| true
            )
            .is_empty());
        let rec = book.tick(
            t0 + Duration::from_secs(61),
            Duration::from_secs(60),
            |_| true,
        );
        assert_eq!(rec.len(), 1);
        assert_eq!(book.health(&gpu.mig_devices[2].uuid), Health::Healthy);
    }

    #[test]
    fn a_mig_xid_marks_only_that_mig_device() {
        let (mut book, inv, policy) = setup();
        let gpu = &inv.gpus[0];
        book.on_event(
            &xid(&gpu.uuid, Some(&gpu.mig_devices[1].uuid), 94),
            Instant::now(),
            &policy,
        );
        assert!(matches!(
            book.health(&gpu.mig_devices[1].uuid),
            Health::Unhealthy(_)
        ));
        assert_eq!(book.health(&gpu.mig_devices[0].uuid), Health::Healthy);
        assert_eq!(book.health(&gpu.uuid), Health::Healthy);
    }

    #[test]
    fn skipped_xids_are_ignored_by_default() {
        let (mut book, inv, policy) = setup();
        for x in crate::config::DEFAULT_SKIPPED_XIDS {
            assert!(matches!(
                book.on_event(&xid(&inv.gpus[0].uuid, None, *x), Instant::now(), &policy),
                Change::Ignored { .. }
            ));
        }
        assert_eq!(book.unhealthy().count(), 0);
    }

    #[test]
    fn a_lost_gpu_recovers_only_when_it_answers_and_not_by_time() {
        let (mut book, inv, policy) = setup();
        let t0 = Instant::now();
        let uuid = inv.gpus[3].uuid.to_string();
        book.on_event(&xid(&uuid, None, XID_FALLEN_OFF_BUS), t0, &policy);
        book.on_event(&xid(&uuid, None, 48), t0, &policy);
        assert_eq!(book.health(&uuid), Health::Unhealthy(Cause::Lost));
        assert!(book
            .tick(t0 + Duration::from_secs(3600), Duration::ZERO, |_| false)
            .is_empty());
        assert_eq!(book.tick(t0, Duration::ZERO, |u| u == uuid).len(), 1);
        assert_eq!(book.health(&uuid), Health::Healthy);
    }
}
