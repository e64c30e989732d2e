//! The allocation ledger (pure): who holds which physical device, across both kubelet APIs.
//!
//! A unit is a whole GPU or one MIG device. A MIG device and its parent GPU overlap: holding the
//! GPU blocks all its MIG devices and holding any MIG device blocks the GPU. The ledger refuses a
//! hold that overlaps another holder's, so no device is ever given to two consumers, whichever
//! API asked. It is rebuilt from what the kubelet reports (PodResources) and the DRA checkpoint.
//!
//! A shared unit (consumable capacity, [`crate::sharing`]) may instead have many share
//! holders, each with its memory and compute: shares exclude every whole hold of the unit and of
//! the units overlapping it (either API), and their sum never exceeds the unit.

use crate::config::{AllocationMode, Partition};
use crate::dra::ClaimUid;
use crate::inventory::{DeviceId, DeviceUuid, Gpu, Inventory, ResourceName};
use crate::sharing::Share;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

/// Keeps the GPUs `keep` accepts, and the links among them.
fn restrict(inv: &Inventory, keep: impl Fn(&Gpu) -> bool) -> Inventory {
    let mut out = inv.clone();
    out.gpus.retain(|g| keep(g));
    let kept: BTreeSet<u32> = out.gpus.iter().map(|g| g.index).collect();
    out.topology
        .links
        .retain(|l| kept.contains(&l.from) && kept.contains(&l.to));
    out
}

/// The part of the inventory the device plugin API may hand out. Never a dynamic-MIG GPU
/// (`mig.dynamic`): it is in MIG mode, so it cannot run CUDA whole, and its instances come and
/// go with DRA claims.
pub fn device_plugin_view(inv: &Inventory, mode: &AllocationMode) -> Inventory {
    match mode {
        AllocationMode::Shared => restrict(inv, |g| !g.mig.dynamic),
        AllocationMode::Partitioned(Partition::DraGpus(dra)) => {
            restrict(inv, |g| !g.mig.dynamic && !dra.contains(&g.index))
        }
        AllocationMode::Partitioned(Partition::MigToDra) => restrict(inv, |g| !g.mig.current),
    }
}

/// The part of the inventory DRA may hand out: always the dynamic-MIG GPUs (no other API can
/// use them), whatever the partition says.
pub fn dra_view(inv: &Inventory, mode: &AllocationMode) -> Inventory {
    match mode {
        AllocationMode::Shared => inv.clone(),
        AllocationMode::Partitioned(Partition::DraGpus(dra)) => {
            restrict(inv, |g| g.mig.dynamic || dra.contains(&g.index))
        }
        AllocationMode::Partitioned(Partition::MigToDra) => restrict(inv, |g| g.mig.current),
    }
}

/// Who holds a unit.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Holder {
    /// A container that got the device through the device plugin API: the Allocate's device
    /// IDs (or those PodResources lists), in the kubelet's order. `pod` is
    /// `namespace/name/container` once PodResources names it, `None` between Allocate and then.
    DevicePlugin {
        resource: ResourceName,
        device_ids: Vec<DeviceId>,
        pod: Option<String>,
    },
    /// A prepared DRA claim.
    Claim { uid: ClaimUid, name: String },
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Holder::DevicePlugin {
                resource,
                device_ids,
                pod: Some(pod),
            } => write!(f, "container {pod} ({resource} {})", device_ids.join(",")),
            Holder::DevicePlugin {
                resource,
                device_ids,
                pod: None,
            } => write!(
                f,
                "a device plugin allocation ({resource} {})",
                device_ids.join(",")
            ),
            Holder::Claim { uid, name } => write!(f, "ResourceClaim {name} (uid {uid})"),
        }
    }
}

impl Holder {
    /// The device IDs of a device-plugin hold (none for a claim).
    fn device_ids(&self) -> BTreeSet<&str> {
        match self {
            Holder::DevicePlugin { device_ids, .. } => {
                device_ids.iter().map(DeviceId::as_str).collect()
            }
            Holder::Claim { .. } => BTreeSet::new(),
        }
    }

    /// Whether two holds may share a unit. The device plugin side counts as one consumer: the
    /// kubelet itself never assigns one device ID twice, and time-sliced replicas of one unit
    /// are meant to be shared. Claims are one consumer each.
    fn same_consumer(&self, other: &Holder) -> bool {
        match (self, other) {
            (Holder::Claim { uid: a, .. }, Holder::Claim { uid: b, .. }) => a == b,
            (Holder::DevicePlugin { .. }, Holder::DevicePlugin { .. }) => true,
            _ => false,
        }
    }
}

/// A refused hold: the unit (or an overlapping one) is taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("device {unit} is held by {holder}{}", overlap.as_ref().map(|o| format!(" (through overlapping device {o})")).unwrap_or_default())]
pub struct Held {
    pub unit: DeviceUuid,
    pub holder: Holder,
    /// The overlapping unit actually held, when not `unit` itself.
    pub overlap: Option<DeviceUuid>,
}

/// A share of a unit that a claim holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareHold {
    pub holder: Holder,
    /// The allocation result's `shareID`.
    pub share_id: String,
    pub share: Share,
}

/// One share a claim asks to hold: the unit, the allocation's `shareID`, what it consumes, and
/// the unit's whole capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareRequest {
    pub unit: DeviceUuid,
    pub share_id: String,
    pub share: Share,
    pub capacity: Share,
}

/// A refused share.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShareRefused {
    /// A whole hold of the unit, or a hold of an overlapping unit, blocks it.
    #[error(transparent)]
    Held(Held),
    /// The shares already held leave too little.
    #[error("device {unit} cannot give {want}: {free_memory} memory and {free_compute}% compute are free, the rest held by {}", holders.join(", "))]
    Full {
        unit: DeviceUuid,
        want: Share,
        free_memory: String,
        free_compute: u32,
        /// Each holder with its share.
        holders: Vec<String>,
    },
}

/// A device-plugin Allocate that PodResources has not listed yet.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pending {
    /// The Allocate's device IDs; listing any of them on the unit confirms it.
    ids: BTreeSet<String>,
    at: Instant,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    holds: BTreeMap<DeviceUuid, Holder>,
    /// Per unit, the device-plugin Allocates PodResources has not listed yet. PodResources may
    /// lag Allocate, so these alone keep a hold for the grace period. A hold with none left
    /// lives exactly as long as PodResources lists its unit: once listed, a unit missing from a
    /// listing means its container is gone. Per Allocate, not per unit, because time-sliced
    /// replicas share a unit: a listed replica must not vouch for a newer one's Allocate.
    pending: BTreeMap<DeviceUuid, Vec<Pending>>,
    /// Per shared unit, its share holders; a unit is here only while it has one.
    shares: BTreeMap<DeviceUuid, Vec<ShareHold>>,
    /// Per unit in `shares`, its whole capacity as the last hold recorded it.
    capacity: BTreeMap<DeviceUuid, Share>,
    parent: BTreeMap<DeviceUuid, DeviceUuid>,
    children: BTreeMap<DeviceUuid, Vec<DeviceUuid>>,
}

impl Ledger {
    pub fn new(inv: &Inventory) -> Ledger {
        let mut l = Ledger::default();
        l.set_inventory(inv);
        l
    }

    /// Learns the MIG/GPU overlap relation. Holds on units that vanished are kept: a pod or claim
    /// still holds them until it is released, and they must not be handed out if they return.
    pub fn set_inventory(&mut self, inv: &Inventory) {
        self.parent.clear();
        self.children.clear();
        for g in &inv.gpus {
            for m in &g.mig_devices {
                self.parent.insert(m.uuid.clone(), g.uuid.clone());
                self.children
                    .entry(g.uuid.clone())
                    .or_default()
                    .push(m.uuid.clone());
            }
        }
    }

    /// Units that overlap `unit`, itself first.
    fn overlapping(&self, unit: &DeviceUuid) -> Vec<DeviceUuid> {
        let mut out = vec![unit.clone()];
        if let Some(p) = self.parent.get(unit) {
            out.push(p.clone());
        }
        if let Some(c) = self.children.get(unit) {
            out.extend(c.iter().cloned());
        }
        out
    }

    /// Another consumer's hold (whole, or a share) that blocks `unit` for `who`, if any.
    pub fn conflict(&self, unit: &DeviceUuid, who: &Holder) -> Option<Held> {
        self.overlapping(unit).into_iter().find_map(|u| {
            let whole = self.holds.get(&u).into_iter();
            let shared = self.shares.get(&u).into_iter().flatten().map(|s| &s.holder);
            let h = whole.chain(shared).find(|h| !h.same_consumer(who))?;
            Some(Held {
                unit: unit.clone(),
                holder: h.clone(),
                overlap: (u != *unit).then_some(u),
            })
        })
    }

    /// Holds every share for `who`, or none: each unit must have no whole hold (nor an
    /// overlapping unit any hold) of another consumer, and its shares, with these, must fit its
    /// capacity. A share `who` already holds under the same `shareID` is replaced, so a
    /// repeated prepare is idempotent.
    pub fn hold_shares(&mut self, want: &[ShareRequest], who: &Holder) -> Result<(), ShareRefused> {
        for r in want {
            if let Some(held) = self.share_blocker(&r.unit, who) {
                return Err(ShareRefused::Held(held));
            }
            let others: Vec<&ShareHold> = self
                .shares
                .get(&r.unit)
                .into_iter()
                .flatten()
                .filter(|s| !(s.holder == *who && want.iter().any(|w| w.share_id == s.share_id)))
                .collect();
            let mine = want.iter().filter(|w| w.unit == r.unit).map(|w| w.share);
            let used = others
                .iter()
                .map(|s| s.share)
                .chain(mine)
                .fold((0u64, 0u32), |(m, c), s| {
                    (m.saturating_add(s.memory), c.saturating_add(s.compute))
                });
            if used.0 > r.capacity.memory || used.1 > r.capacity.compute {
                let taken = others.iter().fold((0u64, 0u32), |(m, c), s| {
                    (
                        m.saturating_add(s.share.memory),
                        c.saturating_add(s.share.compute),
                    )
                });
                return Err(ShareRefused::Full {
                    unit: r.unit.clone(),
                    want: r.share,
                    free_memory: crate::quantity::Quantity::from_u64(
                        r.capacity.memory.saturating_sub(taken.0),
                        crate::quantity::Format::BinarySI,
                    )
                    .to_string(),
                    free_compute: r.capacity.compute.saturating_sub(taken.1),
                    holders: others
                        .iter()
                        .map(|s| format!("{} ({})", s.holder, s.share))
                        .collect(),
                });
            }
        }
        for r in want {
            let list = self.shares.entry(r.unit.clone()).or_default();
            list.retain(|s| !(s.holder == *who && s.share_id == r.share_id));
            list.push(ShareHold {
                holder: who.clone(),
                share_id: r.share_id.clone(),
                share: r.share,
            });
            self.capacity.insert(r.unit.clone(), r.capacity);
        }
        Ok(())
    }

    /// What blocks a share of `unit` for `who`: another consumer's whole hold of it or of an
    /// overlapping unit, or any hold of another consumer on an overlapping unit. Other shares
    /// of `unit` itself do not block (capacity decides).
    fn share_blocker(&self, unit: &DeviceUuid, who: &Holder) -> Option<Held> {
        self.overlapping(unit).into_iter().find_map(|u| {
            let whole = self.holds.get(&u).filter(|h| !h.same_consumer(who));
            let shared = || {
                (u != *unit)
                    .then(|| {
                        self.shares_of(&u)
                            .iter()
                            .map(|s| &s.holder)
                            .find(|h| !h.same_consumer(who))
                    })
                    .flatten()
            };
            whole.or_else(shared).map(|h| Held {
                unit: unit.clone(),
                holder: h.clone(),
                overlap: (u != *unit).then(|| u.clone()),
            })
        })
    }

    /// The share holders of `unit` (none when it is not shared or no share is held).
    pub fn shares_of(&self, unit: &str) -> &[ShareHold] {
        self.shares.get(unit).map_or(&[], Vec::as_slice)
    }

    /// Every unit with at least one share held, and its holders.
    pub fn shares(&self) -> impl Iterator<Item = (&DeviceUuid, &Vec<ShareHold>)> {
        self.shares.iter()
    }

    /// Holds every unit for `who`, or none of them.
    pub fn hold_all(
        &mut self,
        units: &[DeviceUuid],
        who: &Holder,
        now: Instant,
    ) -> Result<(), Held> {
        if let Some(held) = units.iter().find_map(|u| self.conflict(u, who)) {
            return Err(held);
        }
        let ids: BTreeSet<String> = who.device_ids().into_iter().map(String::from).collect();
        for u in units {
            self.holds.insert(u.clone(), who.clone());
            if matches!(who, Holder::DevicePlugin { .. }) {
                self.pending.entry(u.clone()).or_default().push(Pending {
                    ids: ids.clone(),
                    at: now,
                });
            }
        }
        Ok(())
    }

    /// Reconciles the device plugin's holds with what the kubelet reports in use (`in_use`:
    /// unit -> (holder naming the listed device IDs, `namespace/pod/container`)), as listed by a
    /// PodResources List sent at `listed_at`. Listed units are held (and named) and confirm the
    /// Allocates of those device IDs made before `listed_at`. An unlisted unit is released at
    /// once unless an Allocate of it that PodResources has never listed is younger than `grace`.
    /// Returns (units newly held, units released, conflicts).
    pub fn sync_device_plugin(
        &mut self,
        in_use: &BTreeMap<DeviceUuid, (Holder, String)>,
        listed_at: Instant,
        grace: Duration,
    ) -> (Vec<DeviceUuid>, Vec<DeviceUuid>, Vec<Held>) {
        let mut added = Vec::new();
        let mut conflicts = Vec::new();
        for (unit, (holder, pod)) in in_use {
            match self.holds.get(unit) {
                Some(Holder::DevicePlugin { .. }) => {}
                _ => match self.hold_all(std::slice::from_ref(unit), holder, listed_at) {
                    // Learned from the listing itself (e.g. rebuilt after a restart): listed.
                    Ok(()) => added.push(unit.clone()),
                    Err(held) => conflicts.push(held),
                },
            }
            self.name_pod(unit, pod);
            let listed = holder.device_ids();
            if let Some(p) = self.pending.get_mut(unit) {
                // An Allocate after the List was sent cannot be what the listing shows: the
                // kubelet may have handed a just-freed device ID to a new container.
                p.retain(|a| {
                    a.at > listed_at || !a.ids.iter().any(|i| listed.contains(i.as_str()))
                });
            }
        }
        for p in self.pending.values_mut() {
            // An Allocate never listed within the grace period protects nothing any more.
            p.retain(|a| listed_at.saturating_duration_since(a.at) < grace);
        }
        self.pending.retain(|_, p| !p.is_empty());
        let pending: BTreeSet<DeviceUuid> = self.pending.keys().cloned().collect();
        let released =
            self.release_device_plugin_unless(|u, _| in_use.contains_key(u) || pending.contains(u));
        (added, released, conflicts)
    }

    /// Releases everything a claim holds, whole units and shares; returns the units it held.
    pub fn release_claim(&mut self, uid: &str) -> Vec<DeviceUuid> {
        let mine = |h: &Holder| matches!(h, Holder::Claim { uid: u, .. } if *u == *uid);
        let mut out = self.release_where(mine);
        for (unit, list) in self.shares.iter_mut() {
            let before = list.len();
            list.retain(|s| !mine(&s.holder));
            if list.len() != before && !out.contains(unit) {
                out.push(unit.clone());
            }
        }
        self.shares.retain(|_, l| !l.is_empty());
        let capacity = std::mem::take(&mut self.capacity);
        self.capacity = capacity
            .into_iter()
            .filter(|(u, _)| self.shares.contains_key(u))
            .collect();
        out
    }

    /// Releases device-plugin holds for which `keep` is false; returns the units freed.
    pub fn release_device_plugin_unless(
        &mut self,
        keep: impl Fn(&str, &Holder) -> bool,
    ) -> Vec<DeviceUuid> {
        let gone: Vec<DeviceUuid> = self
            .holds
            .iter()
            .filter(|(u, h)| matches!(h, Holder::DevicePlugin { .. }) && !keep(u, h))
            .map(|(u, _)| u.clone())
            .collect();
        for u in &gone {
            self.holds.remove(u);
            self.pending.remove(u);
        }
        gone
    }

    fn release_where(&mut self, pred: impl Fn(&Holder) -> bool) -> Vec<DeviceUuid> {
        let gone: Vec<DeviceUuid> = self
            .holds
            .iter()
            .filter(|(_, h)| pred(h))
            .map(|(u, _)| u.clone())
            .collect();
        for u in &gone {
            self.holds.remove(u);
            self.pending.remove(u);
        }
        gone
    }

    /// Names the pod of a device-plugin hold once PodResources reports it.
    pub fn name_pod(&mut self, unit: &str, pod: &str) {
        if let Some(Holder::DevicePlugin { pod: p, .. }) = self.holds.get_mut(unit) {
            *p = Some(pod.to_string());
        }
    }

    pub fn holder(&self, unit: &str) -> Option<&Holder> {
        self.holds.get(unit)
    }

    pub fn holds(&self) -> impl Iterator<Item = (&DeviceUuid, &Holder)> {
        self.holds.iter()
    }

    /// Units blocked for `who`: held by someone else (whole or a share), directly or through
    /// an overlap.
    pub fn blocked_for(&self, who: &Holder) -> BTreeSet<DeviceUuid> {
        let mut out = BTreeSet::new();
        let shared = self
            .shares
            .iter()
            .flat_map(|(u, l)| l.iter().map(move |s| (u, &s.holder)));
        for (u, h) in self.holds.iter().chain(shared) {
            if h.same_consumer(who) {
                continue;
            }
            out.extend(self.overlapping(u));
        }
        out
    }

    /// Units the device plugin side holds, directly or through an overlap: what DRA must not
    /// offer right now.
    pub fn device_plugin_blocked(&self) -> BTreeSet<DeviceUuid> {
        self.holds
            .iter()
            .filter(|(_, h)| matches!(h, Holder::DevicePlugin { .. }))
            .flat_map(|(u, _)| self.overlapping(u))
            .collect()
    }

    /// Checks the invariant: no two different consumers hold overlapping units, a share never
    /// meets another consumer's whole hold, and a unit's shares fit its capacity. (The
    /// ledger keeps it by construction; the tests check that it does.)
    #[cfg(test)]
    fn check_invariant(&self) -> Result<(), String> {
        for (u, h) in &self.holds {
            for o in self.overlapping(u).into_iter().skip(1) {
                if let Some(h2) = self.holds.get(&o) {
                    if !h.same_consumer(h2) {
                        return Err(format!("{u} held by {h} overlaps {o} held by {h2}"));
                    }
                }
            }
        }
        for (u, list) in &self.shares {
            for s in list {
                if let Some(h) = self.share_blocker(u, &s.holder) {
                    return Err(format!("share of {u} held by {} meets {h}", s.holder));
                }
            }
            let cap = self.capacity.get(u).copied().unwrap_or_default();
            let memory: u64 = list.iter().map(|s| s.share.memory).sum();
            let compute: u32 = list.iter().map(|s| s.share.compute).sum();
            if memory > cap.memory || compute > cap.compute {
                return Err(format!(
                    "shares of {u} ({memory} bytes, {compute}%) exceed {cap}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(uid: &str) -> Holder {
        Holder::Claim {
            uid: ClaimUid::parse(uid).unwrap(),
            name: format!("ns/{uid}"),
        }
    }

    #[test]
    fn device_plugin_replicas_share_a_unit_but_block_claims() {
        let inv = crate::sim::load("pcie-l4x4").unwrap();
        let mut l = Ledger::new(&inv);
        let u = vec![inv.gpus[0].uuid.clone()];
        l.hold_all(&u, &dp("GPU-a::0"), Instant::now()).unwrap();
        l.hold_all(&u, &dp("GPU-a::1"), Instant::now()).unwrap();
        assert!(l.hold_all(&u, &claim("c"), Instant::now()).is_err());
        assert_eq!(l.release_device_plugin_unless(|_, _| false), u);
        l.hold_all(&u, &claim("c"), Instant::now()).unwrap();
    }

    #[test]
    fn partitions_give_each_api_disjoint_devices() {
        let inv = crate::sim::load("a100-mig-mixed").unwrap();
        let mig = AllocationMode::Partitioned(Partition::MigToDra);
        assert_eq!(
            device_plugin_view(&inv, &mig)
                .gpus
                .iter()
                .map(|g| g.index)
                .collect::<Vec<_>>(),
            [3]
        );
        assert_eq!(
            dra_view(&inv, &mig)
                .gpus
                .iter()
                .map(|g| g.index)
                .collect::<Vec<_>>(),
            [0, 1, 2]
        );
        let split = AllocationMode::Partitioned(Partition::DraGpus(BTreeSet::from([1, 2])));
        let dp = device_plugin_view(&inv, &split);
        assert_eq!(dp.gpus.iter().map(|g| g.index).collect::<Vec<_>>(), [0, 3]);
        assert_eq!(dp.topology.links.len(), 1);
        assert_eq!(dra_view(&inv, &AllocationMode::Shared), inv);
    }

    #[test]
    fn dynamic_mig_gpus_belong_to_dra_in_every_mode() {
        let mut inv = crate::sim::load("a100-mig-mixed").unwrap();
        inv.gpus[1].mig.dynamic = true;
        let dp_gpus = |mode: &AllocationMode| -> Vec<u32> {
            device_plugin_view(&inv, mode)
                .gpus
                .iter()
                .map(|g| g.index)
                .collect()
        };
        let dra_gpus = |mode: &AllocationMode| -> Vec<u32> {
            dra_view(&inv, mode).gpus.iter().map(|g| g.index).collect()
        };
        let split = AllocationMode::Partitioned(Partition::DraGpus(BTreeSet::from([2])));
        let mig = AllocationMode::Partitioned(Partition::MigToDra);
        assert_eq!(dp_gpus(&AllocationMode::Shared), [0, 2, 3]);
        assert_eq!(dp_gpus(&split), [0, 3]);
        assert_eq!(dp_gpus(&mig), [3]);
        assert_eq!(dra_gpus(&AllocationMode::Shared), [0, 1, 2, 3]);
        assert_eq!(dra_gpus(&split), [1, 2]);
        assert_eq!(dra_gpus(&mig), [0, 1, 2]);
        // Its links go with it.
        assert!(device_plugin_view(&inv, &AllocationMode::Shared)
            .topology
            .links
            .iter()
            .all(|l| l.from != 1 && l.to != 1));
    }

    #[test]
    fn device_plugin_holds_follow_pod_resources_with_a_grace_period() {
        let inv = crate::sim::load("pcie-l4x4").unwrap();
        let mut l = Ledger::new(&inv);
        let t0 = Instant::now();
        let grace = Duration::from_secs(30);
        let (a, b) = (inv.gpus[0].uuid.clone(), inv.gpus[1].uuid.clone());
        l.hold_all(std::slice::from_ref(&a), &dp(&a), t0).unwrap();
        let none = BTreeMap::new();
        assert!(
            l.sync_device_plugin(&none, t0 + Duration::from_secs(5), grace)
                .1
                .is_empty(),
            "fresh allocations wait for PodResources"
        );
        let listed = BTreeMap::from([(b.clone(), (dp(&b), "ns/p/c".to_string()))]);
        let (added, released, conflicts) =
            l.sync_device_plugin(&listed, t0 + Duration::from_secs(31), grace);
        assert_eq!(
            (added, released, conflicts.len()),
            (vec![b.clone()], vec![a], 0)
        );
        assert!(
            matches!(l.holder(&b), Some(Holder::DevicePlugin { pod: Some(p), .. }) if p == "ns/p/c")
        );
    }

    /// A PodResources listing: (unit, listed device ID, `namespace/pod/container`).
    fn listing(entries: &[(&str, &str, &str)]) -> BTreeMap<DeviceUuid, (Holder, String)> {
        entries
            .iter()
            .map(|(u, id, pod)| (DeviceUuid::parse(*u).unwrap(), (dp(id), pod.to_string())))
            .collect()
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_listed_unit_missing_from_the_next_listing_is_released_at_that_sync() {
        let inv = crate::sim::load("pcie-l4x4").unwrap();
        let mut l = Ledger::new(&inv);
        let (t0, grace) = (Instant::now(), secs(30.0));
        let a = inv.gpus[0].uuid.clone();
        l.hold_all(std::slice::from_ref(&a), &dp(&a), t0).unwrap();
        let listed = listing(&[(&a, &a, "ns/p/c")]);
        assert_eq!(
            l.sync_device_plugin(&listed, t0 + secs(0.5), grace),
            (vec![], vec![], vec![]),
            "an Allocate PodResources lists is kept"
        );
        assert!(
            matches!(l.holder(&a), Some(Holder::DevicePlugin { pod: Some(p), .. }) if p == "ns/p/c")
        );
        assert!(l.conflict(&a, &claim("c")).is_some());
        // The container ended: the first listing without it releases it, long before grace.
        let (_, released, _) = l.sync_device_plugin(&BTreeMap::new(), t0 + secs(1.0), grace);
        assert_eq!(released, vec![a.clone()]);
        assert!(l.device_plugin_blocked().is_empty());
        l.hold_all(std::slice::from_ref(&a), &claim("c"), t0 + secs(1.0))
            .unwrap();
        l.check_invariant().unwrap();
    }

    #[test]
    fn an_allocate_never_listed_is_kept_until_the_grace_period_ends() {
        let inv = crate::sim::load("pcie-l4x4").unwrap();
        let mut l = Ledger::new(&inv);
        let (t0, grace) = (Instant::now(), secs(30.0));
        let (a, b) = (inv.gpus[0].uuid.clone(), inv.gpus[1].uuid.clone());
        l.hold_all(std::slice::from_ref(&a), &dp(&a), t0).unwrap();
        // Listings that show other units, or none, do not end an Allocate not yet listed.
        let other = listing(&[(&b, &b, "ns/q/c")]);
        for t in [0.5, 1.0, 10.0, 29.9] {
            let (_, released, _) = l.sync_device_plugin(&other, t0 + secs(t), grace);
            assert!(released.is_empty(), "released at {t} s");
        }
        assert!(l.conflict(&a, &claim("c")).is_some());
        let (_, released, _) = l.sync_device_plugin(&other, t0 + grace, grace);
        assert_eq!(released, vec![a]);
    }

    #[test]
    fn a_listing_sent_before_an_allocate_does_not_count_as_listing_it() {
        let inv = crate::sim::load("pcie-l4x4").unwrap();
        let mut l = Ledger::new(&inv);
        let (t0, grace) = (Instant::now(), secs(30.0));
        let a = inv.gpus[0].uuid.clone();
        l.hold_all(std::slice::from_ref(&a), &dp(&a), t0).unwrap();
        l.sync_device_plugin(&listing(&[(&a, &a, "ns/old/c")]), t0 + secs(0.5), grace);
        // `old` ends and the kubelet gives the same device ID to `new` while a List (sent
        // before that Allocate, still showing `old`) is answered.
        l.hold_all(std::slice::from_ref(&a), &dp(&a), t0 + secs(0.8))
            .unwrap();
        l.sync_device_plugin(&listing(&[(&a, &a, "ns/old/c")]), t0 + secs(0.7), grace);
        let (_, released, _) = l.sync_device_plugin(&BTreeMap::new(), t0 + secs(1.2), grace);
        assert!(released.is_empty(), "new's Allocate was never listed");
        assert!(l.conflict(&a, &claim("c")).is_some());
    }

    #[test]
    fn a_unit_released_and_allocated_to_a_new_pod_is_protected_again_until_listed() {
        let inv = crate::sim::load("pcie-l4x4").unwrap();
        let mut l = Ledger::new(&inv);
        let (t0, grace) = (Instant::now(), secs(30.0));
        let a = inv.gpus[0].uuid.clone();
        l.hold_all(std::slice::from_ref(&a), &dp(&a), t0).unwrap();
        l.sync_device_plugin(&listing(&[(&a, &a, "ns/p1/c")]), t0 + secs(0.5), grace);
        let (_, released, _) = l.sync_device_plugin(&BTreeMap::new(), t0 + secs(1.0), grace);
        assert_eq!(released, vec![a.clone()]);
        // A new pod gets it: not listed yet, so the grace period protects it again...
        l.hold_all(std::slice::from_ref(&a), &dp(&a), t0 + secs(1.2))
            .unwrap();
        let (_, released, _) = l.sync_device_plugin(&BTreeMap::new(), t0 + secs(1.5), grace);
        assert!(released.is_empty());
        assert!(
            matches!(l.holder(&a), Some(Holder::DevicePlugin { pod: None, .. })),
            "the old pod's name is gone with its hold"
        );
        // ...until it is listed, and then its end releases it at once.
        l.sync_device_plugin(&listing(&[(&a, &a, "ns/p2/c")]), t0 + secs(2.0), grace);
        assert!(
            matches!(l.holder(&a), Some(Holder::DevicePlugin { pod: Some(p), .. }) if p == "ns/p2/c")
        );
        let (_, released, _) = l.sync_device_plugin(&BTreeMap::new(), t0 + secs(2.5), grace);
        assert_eq!(released, vec![a]);
    }

    #[test]
    fn a_listed_replica_does_not_vouch_for_another_replicas_allocate() {
        let inv = crate::sim::load("pcie-l4x4").unwrap();
        let mut l = Ledger::new(&inv);
        let (t0, grace) = (Instant::now(), secs(30.0));
        let a = inv.gpus[0].uuid.clone();
        let (r0, r1) = (format!("{a}::0"), format!("{a}::1"));
        l.hold_all(std::slice::from_ref(&a), &dp(&r0), t0).unwrap();
        l.hold_all(std::slice::from_ref(&a), &dp(&r1), t0 + secs(0.1))
            .unwrap();
        // Only replica 0's container is listed; it ends before replica 1's is.
        l.sync_device_plugin(&listing(&[(&a, &r0, "ns/p0/c")]), t0 + secs(0.5), grace);
        let (_, released, _) = l.sync_device_plugin(&BTreeMap::new(), t0 + secs(1.0), grace);
        assert!(released.is_empty(), "replica 1 is still protected");
        let (_, released, _) = l.sync_device_plugin(&BTreeMap::new(), t0 + secs(30.1), grace);
        assert_eq!(released, vec![a]);
    }

    #[test]
    fn holds_rebuilt_from_pod_resources_after_a_restart_count_as_listed() {
        let inv = crate::sim::load("dgx-h100").unwrap();
        let (t0, grace) = (Instant::now(), secs(30.0));
        let (a, b) = (inv.gpus[0].uuid.clone(), inv.gpus[1].uuid.clone());
        // A restarted agent: a new ledger whose first knowledge is a PodResources listing.
        let mut l = Ledger::new(&inv);
        let both = listing(&[(&a, &a, "ns/p/c"), (&b, &b, "ns/q/c")]);
        let (added, released, conflicts) = l.sync_device_plugin(&both, t0, grace);
        assert_eq!(
            (added, released, conflicts),
            (vec![a.clone(), b.clone()], vec![], vec![])
        );
        assert!(l.conflict(&a, &claim("c")).is_some());
        // One pod ends: released at the next sync, not after the grace period.
        let (_, released, _) =
            l.sync_device_plugin(&listing(&[(&b, &b, "ns/q/c")]), t0 + secs(0.5), grace);
        assert_eq!(released, vec![a]);
        assert!(l.conflict(&b, &claim("c")).is_some());
    }

    fn dp(id: &str) -> Holder {
        Holder::DevicePlugin {
            resource: ResourceName::gpu(),
            device_ids: id.split(',').map(|i| DeviceId::parse(i).unwrap()).collect(),
            pod: None,
        }
    }

    #[test]
    fn a_gpu_and_its_mig_devices_block_each_other() {
        let inv = crate::sim::load("a100-mig-mixed").unwrap();
        let mut l = Ledger::new(&inv);
        let gpu = inv.gpus[0].uuid.clone();
        let mig = inv.gpus[0].mig_devices[1].uuid.clone();
        l.hold_all(std::slice::from_ref(&mig), &claim("c1"), Instant::now())
            .unwrap();
        let err = l
            .hold_all(std::slice::from_ref(&gpu), &dp(&gpu), Instant::now())
            .unwrap_err();
        assert_eq!(err.overlap.as_deref(), Some(mig.as_str()));
        assert!(err.to_string().contains("ResourceClaim ns/c1"), "{err}");
        assert_eq!(l.release_claim("c1"), vec![mig]);
        l.hold_all(std::slice::from_ref(&gpu), &dp(&gpu), Instant::now())
            .unwrap();
        let other = inv.gpus[0].mig_devices[0].uuid.clone();
        assert!(l.conflict(&other, &claim("c2")).is_some());
        l.check_invariant().unwrap();
    }

    #[test]
    fn holds_are_all_or_nothing_and_idempotent_for_the_same_consumer() {
        let inv = crate::sim::load("dgx-h100").unwrap();
        let mut l = Ledger::new(&inv);
        let u: Vec<DeviceUuid> = inv.gpus.iter().map(|g| g.uuid.clone()).collect();
        l.hold_all(&u[..2], &claim("a"), Instant::now()).unwrap();
        l.hold_all(&u[..2], &claim("a"), Instant::now()).unwrap();
        assert!(l.hold_all(&u[1..3], &claim("b"), Instant::now()).is_err());
        assert!(l.holder(&u[2]).is_none(), "a refused hold takes nothing");
        assert_eq!(l.blocked_for(&claim("b")).len(), 2);
        assert!(l.blocked_for(&claim("a")).is_empty());
    }

    fn share(unit: &DeviceUuid, id: &str, gib: u64, compute: u32) -> ShareRequest {
        ShareRequest {
            unit: unit.clone(),
            share_id: id.into(),
            share: Share {
                memory: gib << 30,
                compute,
            },
            capacity: Share {
                memory: 80 << 30,
                compute: 100,
            },
        }
    }

    #[test]
    fn shares_fit_the_capacity_and_exclude_whole_holds_of_either_api() {
        let inv = crate::sim::load("dgx-a100").unwrap();
        let mut l = Ledger::new(&inv);
        let g = inv.gpus[0].uuid.clone();
        l.hold_shares(&[share(&g, "s1", 40, 50)], &claim("a"))
            .unwrap();
        l.hold_shares(&[share(&g, "s2", 40, 50)], &claim("b"))
            .unwrap();
        // Idempotent for the same claim and share id.
        l.hold_shares(&[share(&g, "s2", 40, 50)], &claim("b"))
            .unwrap();
        let err = l
            .hold_shares(&[share(&g, "s3", 1, 10)], &claim("c"))
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("0 memory and 0% compute are free"), "{text}");
        assert!(
            text.contains("ResourceClaim ns/a") && text.contains("ResourceClaim ns/b"),
            "{text}"
        );
        // Neither the device plugin nor a whole claim gets the GPU while shares are held.
        assert!(l
            .hold_all(std::slice::from_ref(&g), &dp(&g), Instant::now())
            .is_err());
        assert!(l.conflict(&g, &claim("d")).is_some());
        assert!(l.blocked_for(&dp(&g)).contains(&g));
        l.check_invariant().unwrap();
        assert_eq!(l.release_claim("a"), vec![g.clone()]);
        assert_eq!(l.release_claim("b"), vec![g.clone()]);
        assert!(l.shares_of(&g).is_empty());
        l.hold_all(std::slice::from_ref(&g), &dp(&g), Instant::now())
            .unwrap();
        let err = l
            .hold_shares(&[share(&g, "s4", 1, 10)], &claim("c"))
            .unwrap_err();
        assert!(matches!(err, ShareRefused::Held(_)), "{err}");
        l.check_invariant().unwrap();
    }

    #[test]
    fn a_claims_shares_are_all_or_nothing() {
        let inv = crate::sim::load("dgx-a100").unwrap();
        let mut l = Ledger::new(&inv);
        let (g0, g1) = (inv.gpus[0].uuid.clone(), inv.gpus[1].uuid.clone());
        l.hold_shares(&[share(&g1, "x", 60, 10)], &claim("a"))
            .unwrap();
        let two = [share(&g0, "y", 30, 10), share(&g1, "z", 30, 10)];
        assert!(l.hold_shares(&two, &claim("b")).is_err());
        assert!(l.shares_of(&g0).is_empty(), "a refused claim holds nothing");
        // Two shares of one claim on one unit count together.
        let same = [share(&g0, "p", 50, 50), share(&g0, "q", 50, 50)];
        assert!(l.hold_shares(&same, &claim("c")).is_err());
    }
}
