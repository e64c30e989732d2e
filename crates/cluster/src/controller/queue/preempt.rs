//! Preemption's I/O: the candidates a namespace's decision may choose victims from (the
//! counted pods of the namespace and of its quotas' cohorts, priced), and the evictions it
//! decided, made through the Eviction API so that PodDisruptionBudgets hold.
//!
//! An eviction a budget refuses (429) is never turned into a delete: the pod is left out of
//! the next choices for [`BLOCKED_FOR`] (its pod group with it) and the namespace is decided
//! again at once, which picks other victims or tells the waiting pod that none may go. A pod
//! we evicted counts as terminating until the cache shows it so, so a quick second cycle does
//! not choose it again; once gone from the cache it still counts as going for [`GONE_FOR`], as
//! the cohort's ledger reads other namespaces' quota status, which their own cycles settle a
//! moment later (counting it held then would evict one pod more).

use super::watched::Watched;
use crate::controller::cache::Cache;
use crate::controller::namespace::{Decision, Eviction};
use crate::controller::pods::{self, PodRef};
use crate::controller::preempt::Candidate;
use crate::controller::writes::{self, Condition};
use crate::controller_metrics::QueueMetrics;
use crate::quota::{pod_charge, QuotaMode};
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use kube::api::{Api, DeleteParams, EvictParams, Preconditions};
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

/// How long a pod whose eviction a PodDisruptionBudget refused is left out of the choices.
const BLOCKED_FOR: Duration = Duration::from_secs(30);

/// How long a pod we evicted counts as terminating without the cache saying so.
const EVICTED_FOR: Duration = Duration::from_secs(60);

/// How long a victim gone from the cache still counts as going.
const GONE_FOR: Duration = Duration::from_secs(10);

/// The pod condition an evicted pod is given (besides Kubernetes' own `DisruptionTarget`).
pub const PREEMPTED_CONDITION: &str = "gpuplane.dev/Preempted";

/// What the loop remembers of its evictions, and the evictions it makes.
#[derive(Debug, Default)]
pub(super) struct Evictions {
    /// Pods evicted, by uid.
    evicted: HashMap<String, Evicted>,
    /// Pods (and pod groups, as `ns/group`) whose eviction a budget refused, and when.
    blocked: HashMap<String, Instant>,
}

/// A pod we evicted.
#[derive(Debug)]
struct Evicted {
    at: Instant,
    victim: Candidate,
    /// Since when the cache no longer shows it.
    gone: Option<Instant>,
}

impl Evicted {
    fn remembered(&self, now: Instant) -> bool {
        match self.gone {
            Some(g) => now.duration_since(g) < GONE_FOR,
            None => now.duration_since(self.at) < EVICTED_FOR,
        }
    }
}

impl Evictions {
    /// The pods a waiting unit of `ns` may have evicted (empty when no Queue-mode quota of
    /// `ns` preempts or nothing of `ns` waits); never a pod Kueue governs when `kueue`.
    pub(super) fn candidates(
        &mut self,
        ns: &str,
        (queued, kueue): (bool, bool),
        watched: &Watched,
    ) -> Vec<Candidate> {
        let now = Instant::now();
        self.evicted.retain(|_, v| v.remembered(now));
        self.blocked
            .retain(|_, at| now.duration_since(*at) < BLOCKED_FOR);
        let quotas = watched.quotas.in_namespace(ns);
        let preempts = quotas
            .iter()
            .any(|q| q.spec.mode == QuotaMode::Queue && q.spec.preemption.preempts());
        if !queued || !preempts {
            return Vec::new();
        }
        let cohorts: BTreeSet<&String> = quotas
            .iter()
            .filter_map(|q| q.spec.cohort.as_ref())
            .collect();
        let mut namespaces: BTreeSet<String> = watched
            .quotas
            .all()
            .filter(|q| q.spec.cohort.as_ref().is_some_and(|c| cohorts.contains(c)))
            .filter_map(|q| q.metadata.namespace.clone())
            .collect();
        namespaces.insert(ns.to_string());
        let mut out = Vec::new();
        for n in &namespaces {
            let templates = watched.template_specs(n);
            for p in watched.pods.in_namespace(n) {
                let kueues = kueue && gpuplane_model::kueue::managed(&p).is_some();
                if !pods::is_counted(&p) || kueues || self.is_blocked(n, &p) {
                    continue;
                }
                let Ok(charge) = pod_charge(&p, &templates, watched.catalog()) else {
                    continue;
                };
                let mut c = Candidate::of(&p, charge);
                if let Some(v) = self.evicted.get_mut(&c.uid) {
                    c.terminating = true;
                    v.gone = None;
                }
                out.push(c);
            }
        }
        let listed: BTreeSet<String> = out.iter().map(|c| c.uid.clone()).collect();
        for (uid, v) in &mut self.evicted {
            // `ns`'s own usage is counted from its pods, so only other namespaces' lag.
            let lagging = v.victim.namespace != ns && namespaces.contains(&v.victim.namespace);
            if !listed.contains(uid) && lagging {
                v.gone.get_or_insert(now);
                out.push(Candidate {
                    terminating: true,
                    ..v.victim.clone()
                });
            }
        }
        out
    }

    /// When the first pod a budget held comes back into the choices: a namespace that had
    /// candidates is decided again then (budgets are not watched).
    pub(super) fn next_unblock(&self) -> Option<SystemTime> {
        let first = self.blocked.values().min()?;
        let left = (*first + BLOCKED_FOR).saturating_duration_since(Instant::now());
        Some(SystemTime::now() + left)
    }

    fn is_blocked(&self, ns: &str, p: &Pod) -> bool {
        let b = &self.blocked;
        p.metadata.uid.as_ref().is_some_and(|u| b.contains_key(u))
            || pods::group(p).is_some_and(|(g, _)| b.contains_key(&format!("{ns}/{g}")))
    }

    /// Makes the decision's evictions through `client` (`instance` reporting their Events);
    /// whether the namespace should be decided again at once (a budget refused one, or a call
    /// failed). A refused victim's pod group is read from `pods`.
    pub(super) async fn evict(
        &mut self,
        client: &kube::Client,
        instance: &str,
        metrics: &QueueMetrics,
        pods: &Cache<Pod>,
        d: &Decision,
    ) -> bool {
        let mut again = false;
        // After a refusal the rest of that unit's victims wait for the next choice.
        let mut refused: BTreeSet<&str> = BTreeSet::new();
        for e in &d.evictions {
            if refused.contains(e.preemptor.as_str()) || self.evicted.contains_key(&e.victim.uid) {
                continue;
            }
            let api: Api<Pod> = Api::namespaced(client.clone(), &e.victim.namespace);
            let params = EvictParams {
                delete_options: Some(DeleteParams {
                    // Never a newer pod of the same name.
                    preconditions: Some(Preconditions {
                        uid: Some(e.victim.uid.clone()),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                }),
                ..EvictParams::default()
            };
            match api.evict(&e.victim.name, &params).await {
                Ok(_) => {
                    let v = Evicted {
                        at: Instant::now(),
                        victim: e.victim.clone(),
                        gone: None,
                    };
                    self.evicted.insert(e.victim.uid.clone(), v);
                    metrics.preempted(&e.victim.namespace);
                    tracing::info!(pod = %format!("{}/{}", e.victim.namespace, e.victim.name), preemptor = %e.preemptor, "evicted to make room");
                    tell_victim(client, instance, &api, e).await;
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(kube::Error::Api(s)) if s.code == 429 => {
                    refused.insert(&e.preemptor);
                    again = true;
                    self.block(e, pods);
                    let message = format!(
                        "the eviction of pod {}/{} to make room for {} was refused: {} (a PodDisruptionBudget holds it; other pods are chosen or the pod waits)",
                        e.victim.namespace, e.victim.name, e.preemptor, s.message
                    );
                    let pods = &e.preemptor_pods;
                    tell_preemptor(client, instance, pods, "QuotaPreemptionBlocked", &message)
                        .await;
                }
                Err(err) => {
                    refused.insert(&e.preemptor);
                    again = true;
                    metrics.error();
                    tracing::warn!(pod = %format!("{}/{}", e.victim.namespace, e.victim.name), error = %err, "evicting a pod to make room failed; decided again");
                }
            }
        }
        again
    }

    /// A budget refused `e`: its victim, and its pod group, are left out of the choices.
    fn block(&mut self, e: &Eviction, pods: &Cache<Pod>) {
        let now = Instant::now();
        let b = &mut self.blocked;
        b.insert(e.victim.uid.clone(), now);
        let group = pods
            .in_namespace(&e.victim.namespace)
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() == Some(e.victim.uid.as_str()))
            .and_then(|p| pods::group(&p).map(|(g, _)| g));
        if let Some(g) = group {
            b.insert(format!("{}/{g}", e.victim.namespace), now);
        }
    }
}

/// The victim's condition and Event (a pod already gone is not an error).
async fn tell_victim(client: &kube::Client, instance: &str, api: &Api<Pod>, e: &Eviction) {
    let c = Condition {
        type_: PREEMPTED_CONDITION,
        status: true,
        reason: "PreemptedByQuota",
        message: &e.message,
    };
    let mut r = writes::set_pod_condition(api, &e.victim.name, None, c).await;
    if r.is_ok() {
        let events: Api<CoreEvent> = Api::namespaced(client.clone(), &e.victim.namespace);
        let victim = PodRef {
            namespace: e.victim.namespace.clone(),
            name: e.victim.name.clone(),
            uid: e.victim.uid.clone(),
            gate_index: None,
            condition: None,
        };
        r = writes::event(
            &events,
            &victim,
            true,
            "QuotaPreempted",
            &e.message,
            instance,
        )
        .await;
    }
    if let Err(err) = r {
        tracing::warn!(pod = %format!("{}/{}", e.victim.namespace, e.victim.name), error = %err, "recording a preemption on its victim failed");
    }
}

async fn tell_preemptor(
    client: &kube::Client,
    instance: &str,
    pods: &[PodRef],
    reason: &str,
    message: &str,
) {
    for p in pods {
        let events: Api<CoreEvent> = Api::namespaced(client.clone(), &p.namespace);
        let r = writes::event(&events, p, true, reason, message, instance).await;
        if let Err(err) = r {
            tracing::warn!(pod = %format!("{}/{}", p.namespace, p.name), error = %err, "recording a refused preemption failed");
        }
    }
}
