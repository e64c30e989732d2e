//! The object store: JSON objects per resource, one global resourceVersion counter (as etcd's
//! revision), and a bounded history of watch events.

use super::resources::{builtin, ApiError, ResourceInfo};
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

/// (group, version, plural).
pub(crate) type ResKey = (String, String, String);
/// (namespace or "", name).
pub(crate) type ObjKey = (String, String);

pub(crate) fn res_key(info: &ResourceInfo) -> ResKey {
    (
        info.group.clone(),
        info.version.clone(),
        info.plural.clone(),
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as a watch sees it.
#[derive(Debug)]
pub(crate) struct Event {
    pub rv: u64,
    pub res: ResKey,
    pub namespace: String,
    pub kind: EventType,
    pub object: Arc<Value>,
    /// The object before this change (for selector transitions); None for ADDED.
    pub prev: Option<Arc<Value>>,
    /// `object` as JSON, encoded once for every watch that sends it.
    encoded: OnceLock<Vec<u8>>,
}

impl Event {
    pub fn new(
        rv: u64,
        res: ResKey,
        namespace: String,
        kind: EventType,
        object: Arc<Value>,
        prev: Option<Arc<Value>>,
    ) -> Event {
        Event {
            rv,
            res,
            namespace,
            kind,
            object,
            prev,
            encoded: OnceLock::new(),
        }
    }

    pub fn encoded(&self) -> &[u8] {
        self.encoded
            .get_or_init(|| serde_json::to_vec(&*self.object).unwrap_or_default())
    }
}

pub(crate) const DEFAULT_HISTORY: usize = 10_000;

pub(crate) struct Store {
    pub resources: Vec<ResourceInfo>,
    /// Shared with the history: an event holds the object stored and the one it replaced
    /// without copying either.
    pub objects: BTreeMap<ResKey, BTreeMap<ObjKey, Arc<Value>>>,
    pub rv: u64,
    /// Shared with the watches that send them: an event is stored and encoded once, not
    /// once per watch.
    history: VecDeque<Arc<Event>>,
    history_cap: usize,
    /// Every event with rv > this is in `history`; watching from below it is 410 Gone.
    history_start: u64,
    seq: u64,
    notify: watch::Sender<u64>,
}

impl Store {
    pub fn new() -> Store {
        Store {
            resources: builtin(),
            objects: BTreeMap::new(),
            rv: 1,
            history: VecDeque::new(),
            history_cap: DEFAULT_HISTORY,
            history_start: 1,
            seq: 0,
            notify: watch::channel(1).0,
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.notify.subscribe()
    }

    pub fn resource(&self, group: &str, version: &str, plural: &str) -> Option<ResourceInfo> {
        self.resources
            .iter()
            .find(|r| r.group == group && r.version == version && r.plural == plural)
            .cloned()
    }

    pub fn resource_by_kind(&self, api_version: &str, kind: &str) -> Option<ResourceInfo> {
        self.resources
            .iter()
            .find(|r| r.api_version() == api_version && r.kind.eq_ignore_ascii_case(kind))
            .cloned()
    }

    pub fn register(&mut self, info: ResourceInfo) {
        self.resources.retain(|r| res_key(r) != res_key(&info));
        self.resources.push(info);
    }

    pub fn get(&self, info: &ResourceInfo, ns: &str, name: &str) -> Option<&Value> {
        self.objects
            .get(&res_key(info))?
            .get(&(ns.to_string(), name.to_string()))
            .map(|v| &**v)
    }

    /// The stored object itself, shared (an update compares with it and keeps parts of it).
    pub fn get_shared(&self, info: &ResourceInfo, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.objects
            .get(&res_key(info))?
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Objects of a resource in key order, optionally within one namespace.
    pub fn iter<'a>(
        &'a self,
        info: &ResourceInfo,
        ns: Option<&'a str>,
    ) -> impl Iterator<Item = (&'a ObjKey, &'a Value)> + 'a {
        self.objects
            .get(&res_key(info))
            .into_iter()
            .flat_map(|m| m.iter())
            .filter(move |((n, _), _)| ns.is_none_or(|want| want == n))
            .map(|(k, v)| (k, &**v))
    }

    /// Stores `object` at a new resourceVersion and records the event; returns what was stored.
    pub fn commit_put(&mut self, info: &ResourceInfo, mut object: Value) -> Value {
        self.rv += 1;
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string();
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let stored = Arc::new(object);
        let prev = self
            .objects
            .entry(res_key(info))
            .or_default()
            .insert((ns.clone(), name), stored.clone());
        let kind = if prev.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(info, ns, kind, stored.clone(), prev);
        Arc::unwrap_or_clone(stored)
    }

    /// Removes an object at a new resourceVersion; returns it as the DELETED event carries it.
    pub fn commit_delete(&mut self, info: &ResourceInfo, ns: &str, name: &str) -> Option<Value> {
        let key = (ns.to_string(), name.to_string());
        let prev = self.objects.get_mut(&res_key(info))?.remove(&key)?;
        self.rv += 1;
        let mut gone = (*prev).clone();
        gone["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let gone = Arc::new(gone);
        self.record(
            info,
            ns.to_string(),
            EventType::Deleted,
            gone.clone(),
            Some(prev),
        );
        Some(Arc::unwrap_or_clone(gone))
    }

    fn record(
        &mut self,
        info: &ResourceInfo,
        namespace: String,
        kind: EventType,
        object: Arc<Value>,
        prev: Option<Arc<Value>>,
    ) {
        self.history.push_back(Arc::new(Event::new(
            self.rv,
            res_key(info),
            namespace,
            kind,
            object,
            prev,
        )));
        while self.history.len() > self.history_cap {
            if let Some(e) = self.history.pop_front() {
                self.history_start = e.rv;
            }
        }
        self.notify.send_replace(self.rv);
    }

    /// Forgets all history (as an etcd compaction): watches and continue tokens from older
    /// resourceVersions get 410 Gone.
    pub fn compact(&mut self) {
        self.history.clear();
        self.history_start = self.rv;
        self.notify.send_replace(self.rv);
    }

    pub fn set_history_cap(&mut self, cap: usize) {
        self.history_cap = cap.max(1);
    }

    pub fn too_old(&self, rv: u64) -> Option<ApiError> {
        (rv < self.history_start).then(|| {
            ApiError::gone(format!(
                "too old resource version: {rv} ({})",
                self.history_start
            ))
        })
    }

    /// Events of resource `res` after `rv` and the current resourceVersion.
    pub fn events_after(&self, res: &ResKey, rv: u64) -> Result<(Vec<Arc<Event>>, u64), ApiError> {
        if let Some(e) = self.too_old(rv) {
            return Err(e);
        }
        let start = self.history.partition_point(|e| e.rv <= rv);
        let events = self
            .history
            .range(start..)
            .filter(|e| e.res == *res)
            .cloned()
            .collect();
        Ok((events, self.rv))
    }

    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// A v4-shaped UID, unique within the process.
    pub fn new_uid(&mut self) -> String {
        let h = mix(nanos() ^ self.next_seq().rotate_left(40));
        let l = mix(h ^ 0x9e37_79b9_7f4a_7c15);
        format!(
            "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
            h >> 32,
            (h >> 16) & 0xffff,
            h & 0xfff,
            0x8000 | ((l >> 48) & 0x3fff),
            l & 0xffff_ffff_ffff
        )
    }

    /// Five characters as upstream's generateName suffix uses.
    pub fn name_suffix(&mut self) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        let mut x = mix(nanos() ^ self.next_seq());
        (0..5)
            .map(|_| {
                let c = ALPHABET[(x % ALPHABET.len() as u64) as usize] as char;
                x /= ALPHABET.len() as u64;
                c
            })
            .collect()
    }
}

fn nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Now as RFC 3339 in UTC, second precision (as metav1.Time serialises).
pub(crate) fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339(secs)
}

fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_825_600), "2000-02-29T12:00:00Z");
        assert_eq!(rfc3339(1_767_225_599), "2025-12-31T23:59:59Z");
    }

    #[test]
    fn uids_are_unique_and_uuid_shaped() {
        let mut s = Store::new();
        let (a, b) = (s.new_uid(), s.new_uid());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(
            a.split('-').map(str::len).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
    }
}
