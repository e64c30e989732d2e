//! What to write so the API server holds exactly the desired slices (pure).
//!
//! Input: the slices listed for this node and driver, the desired slices, and what the server
//! stored for earlier writes. Output: creates, updates and deletes, plus the pool generation.
//!
//! Slices are matched by name (the renderer's names are stable). Content is compared without
//! server-set metadata, without the pool generation, with taint `timeAdded` ignored and
//! quantities compared by value. The generation rule follows the upstream
//! `resourceslice.Controller`: keep the highest existing generation when at most one slice
//! needs an update and nothing is created or removed (consumers see a consistent pool either
//! way); otherwise bump it by one and rewrite every slice of the pool with it, so consumers
//! ignore the old slices until the new set is complete. Slices an interrupted sync left at an
//! older generation are brought up to the highest one without a further bump (that pool is
//! incomplete, hence unused, until they are). A desired generation above the existing one
//! wins. An unchanged pool, whoever wrote it, therefore needs no writes at all.

use crate::quantity::{Format, Quantity};
use k8s_openapi::api::resource::v1::{Device, DeviceTaint, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use std::collections::{BTreeMap, BTreeSet};

/// The comparable part of a slice: spec without generation, owner references.
#[derive(Debug, Clone, PartialEq)]
pub struct Content {
    spec: ResourceSliceSpec,
    owners: Vec<OwnerReference>,
}

impl Content {
    pub fn of(slice: &ResourceSlice) -> Content {
        let mut spec = slice.spec.clone();
        spec.pool.generation = 0;
        if let Some(devices) = spec.devices.as_mut() {
            devices.iter_mut().for_each(normalize_device);
        }
        if spec.devices.as_ref().is_some_and(Vec::is_empty) {
            spec.devices = None;
        }
        if spec.shared_counters.as_ref().is_some_and(Vec::is_empty) {
            spec.shared_counters = None;
        }
        let mut owners = slice.metadata.owner_references.clone().unwrap_or_default();
        owners.sort_by(|a, b| a.uid.cmp(&b.uid));
        Content { spec, owners }
    }
}

fn normalize_device(d: &mut Device) {
    if let Some(t) = d.taints.as_mut() {
        t.iter_mut().for_each(|t| t.time_added = None);
    }
    if let Some(c) = d.capacity.as_mut() {
        for cap in c.values_mut() {
            // One spelling per value whatever the writer's format; text that is no quantity
            // is compared as written.
            if let Ok(q) = Quantity::parse_trimmed(&cap.value.0) {
                cap.value.0 = q.with_format(Format::BinarySI).to_string();
            }
        }
    }
    if d.attributes.as_ref().is_some_and(BTreeMap::is_empty) {
        d.attributes = None;
    }
    if d.capacity.as_ref().is_some_and(BTreeMap::is_empty) {
        d.capacity = None;
    }
    if d.taints.as_ref().is_some_and(Vec::is_empty) {
        d.taints = None;
    }
    if d.consumes_counters.as_ref().is_some_and(Vec::is_empty) {
        d.consumes_counters = None;
    }
    if d.binding_conditions.as_ref().is_some_and(Vec::is_empty) {
        d.binding_conditions = None;
    }
    if d.binding_failure_conditions
        .as_ref()
        .is_some_and(Vec::is_empty)
    {
        d.binding_failure_conditions = None;
    }
}

/// What the server stored for what we last sent, per slice name. A server may drop fields
/// (taints while the DRADeviceTaints gate is off); remembering the pair keeps that from
/// causing a write on every sync.
pub type Echoes = BTreeMap<String, (Content, Content)>;

/// A delete with the preconditions that make it safe against a concurrent re-create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    pub name: String,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

/// The writes of one sync, in the order to make them.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Existing slices that block a desired name (another pool, driver or node) and must go
    /// before the create.
    pub delete_first: Vec<Delete>,
    /// Replacements, carrying the existing `resourceVersion` for optimistic concurrency.
    pub updates: Vec<ResourceSlice>,
    pub creates: Vec<ResourceSlice>,
    /// Orphans and duplicates: slices of this node and driver that are not desired.
    pub deletes: Vec<Delete>,
    /// The pool generation every written slice carries.
    pub generation: i64,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.delete_first.is_empty()
            && self.updates.is_empty()
            && self.creates.is_empty()
            && self.deletes.is_empty()
    }

    pub fn writes(&self) -> usize {
        self.delete_first.len() + self.updates.len() + self.creates.len() + self.deletes.len()
    }
}

/// Whether an existing slice already says what a desired one says.
pub fn same_content(existing: &ResourceSlice, desired: &ResourceSlice, echoes: &Echoes) -> bool {
    let (e, d) = (Content::of(existing), Content::of(desired));
    if e == d {
        return true;
    }
    let name = desired.metadata.name.as_deref().unwrap_or_default();
    echoes
        .get(name)
        .is_some_and(|(sent, stored)| *sent == d && *stored == e)
}

/// Computes the writes. `desired` must already be checked: unique names, one pool, this
/// driver and node, `resourceSliceCount` equal to its length. `owners` are set on written
/// slices when given. `last_written` is the highest generation this process wrote: a bump
/// goes above it too, so generations stay monotonic even after all slices were deleted.
pub fn plan(
    existing: &[ResourceSlice],
    desired: &[ResourceSlice],
    driver: &str,
    node: &str,
    owners: Option<&[OwnerReference]>,
    echoes: &Echoes,
    last_written: i64,
) -> Plan {
    let mut out = Plan::default();
    let (by_name, obsolete) = sort_existing(existing, desired, driver, node, &mut out);
    let current = by_name
        .values()
        .chain(obsolete.iter())
        .map(|s| s.spec.pool.generation)
        .max()
        .unwrap_or(0);
    // Obsolete slices at an older generation are already ignored by consumers.
    let obsolete_current = obsolete
        .iter()
        .filter(|s| s.spec.pool.generation >= current)
        .count();
    let wanted = desired
        .iter()
        .map(|d| d.spec.pool.generation)
        .max()
        .unwrap_or(0);
    let Matched {
        creates,
        changed,
        stale,
        unchanged,
    } = match_desired(desired, &by_name, owners, echoes, current);

    // Slices an interrupted sync left behind the highest generation mean the pool at that
    // generation is incomplete, so consumers are not using it yet: completing it needs no
    // further bump.
    let incomplete = by_name.values().any(|e| e.spec.pool.generation < current);
    let bump = wanted > current
        || !creates.is_empty()
        || obsolete_current > 0
        || (!incomplete && changed.len() > 1);
    out.generation = if wanted > current {
        wanted.max(last_written.saturating_add(1))
    } else if bump {
        current.max(last_written).saturating_add(1)
    } else {
        current
    };
    let rewrite: Vec<(&ResourceSlice, ResourceSlice)> = if bump {
        changed.into_iter().chain(stale).chain(unchanged).collect()
    } else {
        changed.into_iter().chain(stale).collect()
    };
    out.updates = rewrite
        .into_iter()
        .map(|(e, d)| replacement(e, d, out.generation))
        .collect();
    out.updates
        .sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    out.creates = creates
        .into_iter()
        .map(|mut d| {
            d.spec.pool.generation = out.generation;
            d.metadata = ObjectMeta {
                name: d.metadata.name,
                owner_references: d.metadata.owner_references,
                labels: d.metadata.labels,
                annotations: d.metadata.annotations,
                ..ObjectMeta::default()
            };
            d
        })
        .collect();
    out
}

/// Sorts the existing slices: ours that a desired slice names (the first of each name), by
/// name; ours that no desired slice names (obsolete). Every other slice not being deleted
/// goes into `out`: into `delete_first` when it blocks a desired name, else into `deletes`
/// (with the obsolete ones).
fn sort_existing<'a>(
    existing: &'a [ResourceSlice],
    desired: &[ResourceSlice],
    driver: &str,
    node: &str,
    out: &mut Plan,
) -> (BTreeMap<&'a str, &'a ResourceSlice>, Vec<&'a ResourceSlice>) {
    let pool = desired.first().map(|d| d.spec.pool.name.as_str());
    let desired_names: BTreeSet<&str> = desired
        .iter()
        .filter_map(|d| d.metadata.name.as_deref())
        .collect();
    let is_ours = |s: &ResourceSlice| {
        Some(s.spec.pool.name.as_str()) == pool
            && s.spec.driver == driver
            && s.spec.node_name.as_deref() == Some(node)
            && s.metadata.deletion_timestamp.is_none()
    };

    let mut by_name: BTreeMap<&str, &ResourceSlice> = BTreeMap::new();
    let mut obsolete: Vec<&ResourceSlice> = Vec::new();
    for s in existing {
        let name = s.metadata.name.as_deref().unwrap_or_default();
        if is_ours(s) && desired_names.contains(name) && !by_name.contains_key(name) {
            by_name.insert(name, s);
            continue;
        }
        if s.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let del = Delete {
            name: name.to_string(),
            uid: s.metadata.uid.clone(),
            resource_version: s.metadata.resource_version.clone(),
        };
        if desired_names.contains(name) {
            out.delete_first.push(del);
        } else {
            if is_ours(s) {
                obsolete.push(s);
            }
            out.deletes.push(del);
        }
    }
    (by_name, obsolete)
}

/// The desired slices by what each needs against the existing one of its name.
#[derive(Default)]
struct Matched<'e> {
    /// No existing slice of that name.
    creates: Vec<ResourceSlice>,
    /// The content differs.
    changed: Vec<(&'e ResourceSlice, ResourceSlice)>,
    /// Same content at an older generation than the pool's highest.
    stale: Vec<(&'e ResourceSlice, ResourceSlice)>,
    unchanged: Vec<(&'e ResourceSlice, ResourceSlice)>,
}

fn match_desired<'e>(
    desired: &[ResourceSlice],
    by_name: &BTreeMap<&str, &'e ResourceSlice>,
    owners: Option<&[OwnerReference]>,
    echoes: &Echoes,
    current: i64,
) -> Matched<'e> {
    let mut m = Matched::default();
    for d in desired {
        let mut d = d.clone();
        let name = d.metadata.name.clone().unwrap_or_default();
        let existing = by_name.get(name.as_str()).copied();
        // Owner references are ours to set only when configured; otherwise leave them be.
        d.metadata.owner_references = match owners {
            Some(o) => Some(o.to_vec()),
            None => existing.and_then(|e| e.metadata.owner_references.clone()),
        };
        match existing {
            None => m.creates.push(d),
            Some(e) if !same_content(e, &d, echoes) => m.changed.push((e, d)),
            Some(e) if e.spec.pool.generation < current => m.stale.push((e, d)),
            Some(e) => m.unchanged.push((e, d)),
        }
    }
    m
}

/// The update of `existing` to say `desired` at `generation`: existing metadata (labels,
/// annotations and `resourceVersion` kept), desired spec, taint `timeAdded` carried over for
/// taints that did not change.
fn replacement(existing: &ResourceSlice, desired: ResourceSlice, generation: i64) -> ResourceSlice {
    let mut spec = desired.spec;
    spec.pool.generation = generation;
    if let (Some(new), Some(old)) = (spec.devices.as_mut(), existing.spec.devices.as_ref()) {
        for d in new.iter_mut() {
            let Some(old_d) = old.iter().find(|o| o.name == d.name) else {
                continue;
            };
            let (Some(taints), Some(old_taints)) = (d.taints.as_mut(), old_d.taints.as_ref())
            else {
                continue;
            };
            for t in taints.iter_mut().filter(|t| t.time_added.is_none()) {
                if let Some(o) = old_taints.iter().find(|o| same_taint(o, t)) {
                    t.time_added = o.time_added.clone();
                }
            }
        }
    }
    let meta = &existing.metadata;
    let owner_references = desired.metadata.owner_references;
    ResourceSlice {
        metadata: ObjectMeta {
            name: meta.name.clone(),
            resource_version: meta.resource_version.clone(),
            uid: meta.uid.clone(),
            labels: meta.labels.clone(),
            annotations: meta.annotations.clone(),
            owner_references,
            ..ObjectMeta::default()
        },
        spec,
    }
}

fn same_taint(a: &DeviceTaint, b: &DeviceTaint) -> bool {
    a.key == b.key && a.value == b.value && a.effect == b.effect
}
