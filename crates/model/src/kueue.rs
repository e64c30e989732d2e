//! Kueue beside gpuplane (pure): which pods Kueue governs, and what Kueue says about a
//! workload it holds. Kueue's names are those of sigs.k8s.io/kueue v0.17.0 (the version the lab
//! runs): `pkg/controller/constants` (the queue label), `pkg/constants` (the pod-set label its
//! job integrations put on the pods of an admitted job), `pkg/controller/jobs/pod/constants`
//! (the scheduling gate of its pod integration) and `apis/kueue/v1beta2` (Workload and
//! LocalQueue, read here as JSON: only a few fields matter, and Kueue's Go types are not ours).

use crate::quota::status::set_condition;
use crate::quota::QuotaCondition;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// The label a user puts on a Job or pod to send it through a LocalQueue.
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// The label Kueue puts on the pod template of a job it admits (`PodSetLabel`).
pub const PODSET_LABEL: &str = "kueue.x-k8s.io/podset";
/// The scheduling gate Kueue's pod integration holds a plain pod with until it admits it.
pub const ADMISSION_GATE: &str = "kueue.x-k8s.io/admission";
/// Kueue's API group and the version it stores (v1beta2 since v0.15).
pub const GROUP: &str = "kueue.x-k8s.io";
pub const VERSION: &str = "v1beta2";

/// Why a pod is Kueue's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Managed {
    /// The LocalQueue it names, when it names one (a plain pod; a job's pods do not).
    pub queue: Option<String>,
    /// What marks it as Kueue's, for messages: `label kueue.x-k8s.io/queue-name=train`.
    pub mark: String,
    /// Kueue's admission gate is still on it: Kueue holds it.
    pub held: bool,
}

/// Whether Kueue governs `pod`: it names a LocalQueue, carries Kueue's admission gate, or is
/// a controller-owned pod of a job Kueue admitted (the pod-set label Kueue sets on the job's
/// template when it admits it). A pod a user made by hand with only the pod-set label is not
/// Kueue's: nothing owns it.
pub fn managed(pod: &Pod) -> Option<Managed> {
    let labels = pod.metadata.labels.as_ref();
    let label = |k: &str| {
        labels
            .and_then(|l| l.get(k))
            .filter(|v| !v.is_empty())
            .cloned()
    };
    let held = pod
        .spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == ADMISSION_GATE));
    if let Some(q) = label(QUEUE_LABEL) {
        return Some(Managed {
            mark: format!("label {QUEUE_LABEL}={q}"),
            queue: Some(q),
            held,
        });
    }
    if held {
        return Some(Managed {
            queue: None,
            mark: format!("scheduling gate {ADMISSION_GATE}"),
            held,
        });
    }
    let owned = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true));
    let podset = label(PODSET_LABEL).filter(|_| owned)?;
    Some(Managed {
        queue: None,
        mark: format!("label {PODSET_LABEL}={podset}"),
        held,
    })
}

/// The GpuQuota condition, and the Event when it appears, that says Kueue governs some GPU
/// pods of the quota's namespace.
pub const SHARED_CONDITION: &str = "KueueShared";
pub const SHARED_EVENT: &str = "KueueShared";

/// The GPU pods of one namespace that Kueue governs, as its GpuQuotas tell of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Governed {
    /// The LocalQueues they name.
    queues: BTreeSet<String>,
    /// Some are pods of jobs Kueue admitted (they name no queue).
    job_pods: bool,
}

impl Governed {
    /// Whether `pod` is Kueue's; if so it is counted here.
    pub fn take(&mut self, pod: &Pod) -> bool {
        let Some(m) = managed(pod) else {
            return false;
        };
        match m.queue {
            Some(q) => {
                self.queues.insert(q);
            }
            None => self.job_pods = true,
        }
        true
    }

    /// Sets (or, with no Kueue pods, removes) [`SHARED_CONDITION`] in a quota's `conds`; the
    /// condition's message when it was not there before (for the Event).
    pub fn condition(
        &self,
        conds: &mut Vec<QuotaCondition>,
        generation: Option<i64>,
        now: Timestamp,
    ) -> Option<String> {
        let had = conds.iter().any(|c| c.type_ == SHARED_CONDITION);
        if self.queues.is_empty() && !self.job_pods {
            conds.retain(|c| c.type_ != SHARED_CONDITION);
            return None;
        }
        let mut whose: Vec<String> = Vec::new();
        if !self.queues.is_empty() {
            let q: Vec<&str> = self.queues.iter().map(String::as_str).collect();
            whose.push(format!("of LocalQueue {}", q.join(", ")));
        }
        if self.job_pods {
            whose.push("of jobs Kueue admitted".into());
        }
        let message = format!(
            "GPU pods {} are Kueue's: this GpuQuota does not gate, charge or preempt them, and \
             Kueue's ClusterQueues hold their quota; their GPU-hours still count in \
             status.gpuHours (docs/kueue.md)",
            whose.join(" and ")
        );
        let c = QuotaCondition {
            type_: SHARED_CONDITION.into(),
            status: "True".into(),
            reason: "PodsGovernedByKueue".into(),
            message: message.clone(),
            last_transition_time: String::new(),
            observed_generation: generation,
        };
        set_condition(conds, c, now);
        (!had).then_some(message)
    }
}

/// How far Kueue has taken a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// No quota reserved: it waits in its queue.
    Pending,
    /// Quota reserved, admission checks not all passed yet.
    QuotaReserved,
    Admitted,
    Finished,
}

/// What the explainer needs of one Kueue Workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub namespace: String,
    pub name: String,
    /// Its LocalQueue (`spec.queueName`).
    pub queue: String,
    /// `status.admission.clusterQueue` once Kueue reserved quota for it.
    pub cluster_queue: Option<String>,
    pub stage: Stage,
    /// Kueue's own words: the message of its QuotaReserved condition while that is not True
    /// (why it cannot be admitted), else of the newest condition.
    pub message: String,
    /// Its owners as `(kind, name, uid)`: the Job, or the pod of a plain-pod workload.
    pub owners: Vec<(String, String, String)>,
    /// The pods it makes that ask for GPUs (its pod sets' counts, where the template does).
    pub gpu_pods: u64,
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_str()
}

impl Workload {
    /// A Workload as the API server returns it (`kueue.x-k8s.io/v1beta2`); `None` without a
    /// name.
    pub fn from_json(v: &Value) -> Option<Workload> {
        let name = str_at(v, &["metadata", "name"])?.to_string();
        let conditions: Vec<&Value> = v
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .collect();
        let is_true = |t: &str| {
            conditions
                .iter()
                .any(|c| str_at(c, &["type"]) == Some(t) && str_at(c, &["status"]) == Some("True"))
        };
        let stage = if is_true("Finished") {
            Stage::Finished
        } else if is_true("Admitted") {
            Stage::Admitted
        } else if is_true("QuotaReserved") {
            Stage::QuotaReserved
        } else {
            Stage::Pending
        };
        let reserved_message = conditions
            .iter()
            .find(|c| str_at(c, &["type"]) == Some("QuotaReserved"))
            .filter(|_| stage == Stage::Pending)
            .and_then(|c| str_at(c, &["message"]));
        let newest = conditions
            .iter()
            .max_by_key(|c| str_at(c, &["lastTransitionTime"]).unwrap_or_default())
            .and_then(|c| str_at(c, &["message"]));
        let owners = v
            .pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|o| {
                let s = |k: &str| str_at(o, &[k]).unwrap_or_default().to_string();
                (s("kind"), s("name"), s("uid"))
            })
            .collect();
        let gpu_pods = v
            .pointer("/spec/podSets")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|set| template_asks_gpu(set.pointer("/template/spec")))
            .map(|set| set.get("count").and_then(Value::as_u64).unwrap_or(1))
            .sum();
        Some(Workload {
            gpu_pods,
            namespace: str_at(v, &["metadata", "namespace"])
                .unwrap_or_default()
                .into(),
            name,
            queue: str_at(v, &["spec", "queueName"]).unwrap_or_default().into(),
            cluster_queue: str_at(v, &["status", "admission", "clusterQueue"]).map(Into::into),
            stage,
            message: reserved_message.or(newest).unwrap_or_default().into(),
            owners,
        })
    }

    /// Whether Kueue still holds it (no quota reserved yet).
    pub fn held(&self) -> bool {
        self.stage == Stage::Pending
    }

    /// What it is known by: its first owner as `kind/name` (`job/train`), else itself.
    pub fn owner_ref(&self) -> String {
        match self.owners.first() {
            Some((kind, name, _)) => format!("{}/{name}", kind.to_lowercase()),
            None => format!("workload/{}", self.name),
        }
    }

    /// Whether its pods are made only once Kueue admits it (a suspended job), so nothing but
    /// the Workload tells why they wait.
    pub fn has_no_pods_yet(&self) -> bool {
        !self.owners.iter().any(|(kind, _, _)| kind == "Pod")
    }
}

/// Whether a pod set's template (its pod spec, as JSON) asks for a GPU, by the quota's rule.
fn template_asks_gpu(spec: Option<&Value>) -> bool {
    let Some(Ok(spec)) = spec.map(|s| serde_json::from_value(s.clone())) else {
        return false;
    };
    let pod = Pod {
        spec: Some(spec),
        ..Pod::default()
    };
    crate::quota::governs_pod(&pod)
}

/// A LocalQueue: its ClusterQueue and how many workloads wait in it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalQueue {
    pub cluster_queue: String,
    pub pending: u64,
}

/// LocalQueues as the API server returns them, by (namespace, name).
pub fn local_queues<'a>(
    items: impl IntoIterator<Item = &'a Value>,
) -> BTreeMap<(String, String), LocalQueue> {
    items
        .into_iter()
        .filter_map(|v| {
            let ns = str_at(v, &["metadata", "namespace"])?.to_string();
            let name = str_at(v, &["metadata", "name"])?.to_string();
            let q = LocalQueue {
                cluster_queue: str_at(v, &["spec", "clusterQueue"])
                    .unwrap_or_default()
                    .into(),
                pending: v
                    .pointer("/status/pendingWorkloads")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
            };
            Some(((ns, name), q))
        })
        .collect()
}

/// What the explainer reads of Kueue: Workloads (found by the uid of each owner), and
/// LocalQueues.
#[derive(Clone, Debug, Default)]
pub struct KueueView {
    pub workloads: Vec<Workload>,
    by_owner: BTreeMap<String, usize>,
    pub queues: BTreeMap<(String, String), LocalQueue>,
}

impl KueueView {
    /// From listed Workloads and LocalQueues (JSON, as the API server returns them).
    pub fn new(workloads: &[Value], queues: &[Value]) -> KueueView {
        let workloads: Vec<Workload> = workloads.iter().filter_map(Workload::from_json).collect();
        let by_owner = workloads
            .iter()
            .enumerate()
            .flat_map(|(i, w)| w.owners.iter().map(move |(_, _, uid)| (uid.clone(), i)))
            .collect();
        KueueView {
            workloads,
            by_owner,
            queues: local_queues(queues),
        }
    }

    /// The Workload owned by the object with `uid`.
    pub fn owned_by(&self, uid: &str) -> Option<&Workload> {
        self.by_owner.get(uid).map(|&i| &self.workloads[i])
    }

    /// Workloads Kueue holds whose GPU pods do not exist yet (suspended jobs): what waits
    /// though no pod shows it.
    pub fn held_without_pods(&self) -> impl Iterator<Item = &Workload> {
        self.workloads
            .iter()
            .filter(|w| w.held() && w.has_no_pods_yet() && w.gpu_pods > 0)
    }

    /// Kueue's answer for workload `w` it still holds: where it waits and Kueue's message.
    pub fn held_message(&self, w: &Workload) -> String {
        let queue = self.queues.get(&(w.namespace.clone(), w.queue.clone()));
        let cq = w
            .cluster_queue
            .clone()
            .or_else(|| queue.map(|q| q.cluster_queue.clone()))
            .filter(|c| !c.is_empty());
        let mut out = format!("held by Kueue: Workload {}", w.name);
        match (&cq, w.queue.is_empty()) {
            (Some(cq), false) => out += &format!(" in LocalQueue {} (ClusterQueue {cq})", w.queue),
            (None, false) => out += &format!(" in LocalQueue {} (no such LocalQueue)", w.queue),
            _ => {}
        }
        if let Some(q) = queue.filter(|q| q.pending > 0) {
            out += &format!(", {} pending there", q.pending);
        }
        let says = if w.message.is_empty() {
            "Kueue has not reserved quota for it yet"
        } else {
            &w.message
        };
        out + ": " + says
    }

    /// The answer for a pod Kueue holds (its admission gate is on): from its Workload when
    /// there is one, else what the pod itself says.
    pub fn pod_message(&self, pod: &Pod, managed: &Managed) -> String {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        match self.owned_by(uid) {
            Some(w) => self.held_message(w),
            None => format!(
                "held by Kueue ({}): Kueue has not made its Workload yet",
                managed.mark
            ),
        }
    }
}

#[cfg(test)]
mod tests;
