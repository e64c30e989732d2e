//! What the quota loop writes to a namespace's pods once its quotas are written: the
//! admission gates of released pods removed, and conditions and Events telling each pod why
//! it waits or that it was admitted. Writes run concurrently ([`bounded`]); a failed one is
//! logged and made again in a later cycle.

use super::namespaces::Due;
use super::{quota_names, QueueLoop};
use crate::controller::namespace::{Decision, Note};
use crate::controller::pods::{self, PodRef};
use crate::controller::writes::{self, bounded, Ungated};
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use kube::api::Api;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;
use tokio::time::Instant;

impl QueueLoop {
    /// Removes the gates of the released units and of pods admitted earlier; returns the pods
    /// released that had been told to wait (they are told they are admitted).
    pub(super) async fn release(
        &mut self,
        ns: &str,
        d: &Decision,
        all: &[Arc<Pod>],
    ) -> Vec<PodRef> {
        let mut todo: Vec<PodRef> = d.releases.iter().flatten().cloned().collect();
        todo.extend(
            d.admitted_gated
                .iter()
                .filter(|p| !self.own_writes.is_ungated(&p.uid))
                .cloned(),
        );
        if todo.is_empty() {
            return Vec::new();
        }
        let created: HashMap<&str, SystemTime> = all
            .iter()
            .filter_map(|p| Some((p.metadata.uid.as_deref()?, pods::created(p))))
            .collect();
        let quotas = quota_names(d);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let mut told = Vec::new();
        let results = bounded(self.opts.concurrency, todo, |p| {
            let api = api.clone();
            async move {
                let r = writes::ungate(&api, &p).await;
                (p, r)
            }
        })
        .await;
        for (p, r) in results {
            match r {
                Ok(Ungated::Removed) | Ok(Ungated::AlreadyGone) => {
                    let waited = created
                        .get(p.uid.as_str())
                        .and_then(|c| SystemTime::now().duration_since(*c).ok())
                        .unwrap_or_default();
                    if matches!(r, Ok(Ungated::Removed)) {
                        self.metrics.released(ns, &quotas, waited);
                    }
                    self.own_writes.ungated(&p.uid, ns);
                    if p.condition.is_some() || self.namespaces.was_told(&p.uid) {
                        told.push(p);
                    }
                }
                Ok(Ungated::PodGone) => {}
                Err(e) => {
                    self.metrics.error();
                    tracing::warn!(pod = %format!("{ns}/{}", p.name), error = %e, "removing the admission gate failed; retried next cycle");
                }
            }
        }
        told
    }

    /// Tells waiting pods why (condition always current in kind, numbers refreshed at most
    /// every `note_refresh`; an Event when the kind of reason changes).
    pub(super) async fn notes(&mut self, ns: &str, waiting: &[(PodRef, Note)]) {
        let now = Instant::now();
        let todo = self.namespaces.notes_due(
            waiting,
            now,
            self.opts.note_refresh,
            self.opts.notes_per_cycle,
        );
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let events: Api<CoreEvent> = Api::namespaced(self.client.clone(), ns);
        let instance = self.opts.instance.clone();
        let results = bounded(
            self.opts.concurrency,
            todo,
            |Due {
                 pod: p,
                 note,
                 condition,
                 event,
             }| {
                let (pods, events, instance) = (pods.clone(), events.clone(), instance.clone());
                async move {
                    let mut r = Ok(());
                    if condition {
                        r = writes::set_condition(&pods, &p, false, "Waiting", &note.message).await;
                    }
                    if event && r.is_ok() {
                        let warning = matches!(note.kind, "ExceedsQuota" | "Unpriced" | "BadGroup");
                        r = writes::event(
                            &events,
                            &p,
                            warning,
                            &format!("Quota{}", note.kind),
                            &note.message,
                            &instance,
                        )
                        .await;
                    }
                    (p, note, r)
                }
            },
        )
        .await;
        for (p, note, r) in results {
            match r {
                Ok(()) => self.namespaces.told(ns, &p, note, now),
                Err(e) => {
                    tracing::warn!(pod = %format!("{ns}/{}", p.name), error = %e, "recording why a pod waits failed")
                }
            }
        }
    }

    pub(super) async fn admitted_notes(&mut self, ns: &str, told: Vec<PodRef>) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let events: Api<CoreEvent> = Api::namespaced(self.client.clone(), ns);
        let instance = self.opts.instance.clone();
        let message =
            format!("admitted by the GpuQuotas of namespace {ns}; the scheduling gate is removed");
        for p in &told {
            self.namespaces.admitted(&p.uid);
        }
        let results = bounded(self.opts.concurrency, told, |p| {
            let (pods, events, instance, message) = (
                pods.clone(),
                events.clone(),
                instance.clone(),
                message.clone(),
            );
            async move {
                let mut r = writes::set_condition(&pods, &p, true, "Admitted", &message).await;
                if r.is_ok() {
                    r = writes::event(&events, &p, false, "QuotaAdmitted", &message, &instance)
                        .await;
                }
                (p, r)
            }
        })
        .await;
        for (p, r) in results {
            if let Err(e) = r {
                tracing::warn!(pod = %format!("{ns}/{}", p.name), error = %e, "recording a pod's admission failed");
            }
        }
    }
}
