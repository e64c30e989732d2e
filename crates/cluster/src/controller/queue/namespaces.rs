//! What the quota loop remembers of each namespace between cycles: what it last told each
//! waiting pod, how often the namespace's reconcile failed in a row, and what its pods were
//! priced at.

use crate::controller::namespace::{Charges, Note};
use crate::controller::pods::PodRef;
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What was last said to a waiting pod.
#[derive(Debug, Clone)]
struct Memo {
    namespace: String,
    kind: &'static str,
    message: String,
    at: Instant,
}

/// A note a waiting pod is due: its condition, its Event, or both.
pub(super) struct Due {
    pub(super) pod: PodRef,
    pub(super) note: Note,
    pub(super) condition: bool,
    pub(super) event: bool,
}

/// The loop's memory of namespaces between cycles.
#[derive(Default)]
pub(super) struct Namespaces {
    /// What was last said to each waiting pod, by uid.
    told: HashMap<String, Memo>,
    /// Each namespace's failed reconciles in a row.
    failures: HashMap<String, u32>,
    /// What each namespace's pods were priced at.
    charges: Charges,
}

impl Namespaces {
    /// A reconcile of `ns` succeeded.
    pub(super) fn succeeded(&mut self, ns: &str) {
        self.failures.remove(ns);
    }

    /// A reconcile of `ns` failed; how many have in a row.
    pub(super) fn failed(&mut self, ns: &str) -> u32 {
        let n = self.failures.entry(ns.to_string()).or_insert(0);
        *n += 1;
        *n
    }

    pub(super) fn charges(&mut self) -> &mut Charges {
        &mut self.charges
    }

    /// Pods are priced again (templates or the catalog changed).
    pub(super) fn reprice(&mut self) {
        self.charges.clear();
    }

    /// Forgets what was said to pods of `ns` that are gone.
    pub(super) fn forget_gone(&mut self, ns: &str, pods: &[Arc<Pod>]) {
        let uids: BTreeSet<&str> = pods
            .iter()
            .filter_map(|p| p.metadata.uid.as_deref())
            .collect();
        self.told
            .retain(|uid, m| m.namespace != ns || uids.contains(uid.as_str()));
    }

    /// Whether pod `uid` was told why it waits.
    pub(super) fn was_told(&self, uid: &str) -> bool {
        self.told.contains_key(uid)
    }

    /// Pod `uid` is admitted: it no longer waits for anything.
    pub(super) fn admitted(&mut self, uid: &str) {
        self.told.remove(uid);
    }

    /// Pod `p` of `ns` was told `note` at `at`.
    pub(super) fn told(&mut self, ns: &str, p: &PodRef, note: Note, at: Instant) {
        let memo = Memo {
            namespace: ns.into(),
            kind: note.kind,
            message: note.message,
            at,
        };
        self.told.insert(p.uid.clone(), memo);
    }

    /// What the waiting pods are due, at most `cap` of them: the condition always current in
    /// kind, its numbers refreshed at most every `refresh`; an Event when the kind of reason
    /// changes.
    pub(super) fn notes_due(
        &self,
        waiting: &[(PodRef, Note)],
        now: Instant,
        refresh: Duration,
        cap: usize,
    ) -> Vec<Due> {
        let mut todo = Vec::new();
        for (p, note) in waiting {
            let memo = self.told.get(&p.uid);
            let shown = p
                .condition
                .as_ref()
                .filter(|(_, s, _)| s == "False")
                .map(|(_, _, m)| m.as_str());
            let said = memo.map(|m| m.message.as_str());
            let current =
                shown == Some(note.message.as_str()) || said == Some(note.message.as_str());
            let kind_changed = memo.is_none_or(|m| m.kind != note.kind);
            let refresh_due = memo.is_none_or(|m| now.duration_since(m.at) >= refresh);
            let condition = shown.is_none() || (!current && (kind_changed || refresh_due));
            let event = match memo {
                Some(m) => m.kind != note.kind,
                // After a restart: only pods never told before.
                None => shown.is_none(),
            };
            if condition || event {
                todo.push(Due {
                    pod: p.clone(),
                    note: note.clone(),
                    condition,
                    event,
                });
            }
            if todo.len() >= cap {
                break;
            }
        }
        todo
    }
}
