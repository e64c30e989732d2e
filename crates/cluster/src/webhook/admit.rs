//! The admission decisions (async, over [`Cluster`]): validating and mutating.
//!
//! Validating, Pod CREATE: price the pod ([`crate::quota::pod_charge`]); no GpuQuota in the
//! namespace or nothing GPU-related: allow. A GPU pod lacking a label a quota's
//! `spec.requireLabels` names, or carrying it empty, is denied next, in either mode
//! ([`crate::quota::owners`]). A pod naming a ResourceClaimTemplate not created yet
//! ([`crate::quota::template_wait`]) is allowed, charged nothing, if it carries the gate (the
//! controller prices and releases it once the template exists), else denied. A gated pod of a
//! namespace with a Queue-mode quota: record it as queued (best effort: the gate is what holds it)
//! and allow. Otherwise reserve in every GpuQuota of the namespace, each through that quota's group
//! commit ([`super::commit`]: one status write, with the resourceVersion, for every request waiting
//! for the quota; a conflict decides the batch again); the first that does not fit denies
//! (reservations already made for this request are released again), and so does any failure to read
//! or write (fail closed). `dryRun` requests are checked and nothing is written.
//!
//! Kueue's pods (`gpuplane_model::kueue::managed`) are Kueue's alone when the controller runs
//! with `--kueue`: allowed, never gated, charged or queued; without it, such a GPU pod in a
//! namespace with a GpuQuota is refused, naming the two governors and how to pick one.
//!
//! Validating, Pod UPDATE: only the controller may remove the scheduling gate
//! `quota.gpuplane.dev/admission` while the namespace has a GpuQuota.
//!
//! Validating, ResourceClaim CREATE: a claim the resourceclaim controller makes from a pod's
//! template is charged through the pod; any other claim is priced and reserved as a pod is,
//! in Reject semantics whatever the mode (a claim cannot be gated).
//!
//! Mutating, Pod CREATE: in a namespace with a Queue-mode quota, a GPU pod (one that costs
//! anything, or whose templates cannot be read) without `spec.nodeName` gets the scheduling
//! gate; in any namespace with a GpuQuota, so does a pod naming a template not created yet.

use super::cluster::Cluster;
use super::commit::{Answer, CommitError, Committer};
use super::metrics::{Metrics, Webhook};
use super::review::{AdmissionRequest, Verdict};
use crate::quota::{
    claim_charge, claim_is_extended_resource_claim, claim_is_pod_owned, now_rfc3339, owner_refusal,
    pod_charge, pod_template_names, ungated_denial, waiting_message, Charge, GpuQuota, ObjectKind,
    Op, QuotaMode, Reservation, ReservationKey, ReservationState, SCHEDULING_GATE,
};
use gpuplane_model::kueue;
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use tracing::Instrument;

/// Users that create claims from pods' templates.
pub const CLAIM_CONTROLLER_USERS: &[&str] = &[
    "system:serviceaccount:kube-system:resource-claim-controller",
    "system:kube-controller-manager",
];

/// The user that creates the claims of pods' extended resources served through DRA.
pub const SCHEDULER_USER: &str = "system:kube-scheduler";

/// Settings of the admission logic.
#[derive(Debug, Clone)]
pub struct AdmitOptions {
    /// Users allowed to remove the scheduling gate (the controller's service account).
    pub controller_users: Vec<String>,
    /// Kueue runs in the cluster: the pods it governs are its alone (`gpuplane_model::kueue`).
    pub kueue: bool,
}

pub struct Admitter {
    pub cluster: Arc<Cluster>,
    /// Reservations are written through the group commit of each quota.
    pub commit: Arc<Committer>,
    pub opts: AdmitOptions,
    pub metrics: Arc<Metrics>,
}

fn decode<T: serde::de::DeserializeOwned>(obj: &Option<Value>, what: &str) -> Result<T, Verdict> {
    let v = obj
        .as_ref()
        .ok_or_else(|| Verdict::deny(400, format!("the request has no {what} object")))?;
    T::deserialize(v).map_err(|e| Verdict::deny(400, format!("cannot decode the {what}: {e}")))
}

fn has_gate(pod: &Pod) -> bool {
    pod.spec
        .iter()
        .flat_map(|s| s.scheduling_gates.iter().flatten())
        .any(|g| g.name == SCHEDULING_GATE)
}

/// A pod's price, or the templates it names that are not created yet.
enum Priced {
    Charge(Charge),
    WaitingFor(Vec<String>),
}

/// Why a Kueue pod is refused by a controller not told that Kueue runs: Kueue and the
/// namespace's GpuQuotas would both hold and charge it.
fn kueue_contradiction(
    ns: &str,
    name: &str,
    m: &kueue::Managed,
    quotas: &[Arc<GpuQuota>],
) -> String {
    let names: Vec<&str> = quotas
        .iter()
        .filter_map(|q| q.metadata.name.as_deref())
        .collect();
    format!(
        "pod {ns}/{name} is Kueue's ({}), and namespace {ns} also has GpuQuota {}: both would hold \
         and charge it, and gpuplane's controller is not running beside Kueue. Either run the \
         controller with --kueue (Helm: controller.kueue=true) so Kueue alone governs its pods, or \
         remove the Kueue label so the GpuQuota does (see docs/kueue.md)",
        m.mark,
        names.join(", ")
    )
}

fn outcome(v: Result<Verdict, Verdict>) -> Verdict {
    v.unwrap_or_else(|v| v)
}

/// The span every line logged while deciding an admission carries: which object, which call.
fn admission_span(req: &AdmissionRequest, webhook: &'static str) -> tracing::Span {
    tracing::info_span!(
        "admission",
        webhook,
        kind = %req.kind.kind,
        operation = %req.operation,
        namespace = req.namespace.as_deref().unwrap_or(""),
        name = req.name.as_deref().unwrap_or(""),
        uid = %req.uid,
    )
}

impl Admitter {
    pub async fn validate(&self, req: &AdmissionRequest) -> Verdict {
        self.validate_in_span(req)
            .instrument(admission_span(req, "validate"))
            .await
    }

    pub async fn mutate(&self, req: &AdmissionRequest) -> Verdict {
        self.mutate_in_span(req)
            .instrument(admission_span(req, "mutate"))
            .await
    }

    async fn validate_in_span(&self, req: &AdmissionRequest) -> Verdict {
        let v = if req.sub_resource.as_deref().is_some_and(|s| !s.is_empty()) {
            Verdict::allow()
        } else {
            match (
                req.kind.group.as_str(),
                req.kind.kind.as_str(),
                req.operation.as_str(),
            ) {
                ("", "Pod", "CREATE") => outcome(self.validate_pod_create(req).await),
                ("", "Pod", "UPDATE") => outcome(self.validate_pod_update(req)),
                ("resource.k8s.io", "ResourceClaim", "CREATE") => {
                    outcome(self.validate_claim_create(req).await)
                }
                ("", "Pod", _) | ("resource.k8s.io", "ResourceClaim", _) => Verdict::allow(),
                (g, k, _) => Verdict::deny(
                    400,
                    format!(
                        "this webhook admits Pods and ResourceClaims, not {}{k}",
                        if g.is_empty() {
                            String::new()
                        } else {
                            format!("{g}/")
                        }
                    ),
                ),
            }
        };
        self.metrics.admission(Webhook::Validate, &v);
        v
    }

    async fn mutate_in_span(&self, req: &AdmissionRequest) -> Verdict {
        let v = match (
            req.kind.group.as_str(),
            req.kind.kind.as_str(),
            req.operation.as_str(),
        ) {
            _ if req.sub_resource.as_deref().is_some_and(|s| !s.is_empty()) => Verdict::allow(),
            ("", "Pod", "CREATE") => outcome(self.mutate_pod_create(req).await),
            ("", "Pod", _) => Verdict::allow(),
            (g, k, _) => Verdict::deny(400, format!("this webhook mutates Pods, not {g}/{k}")),
        };
        self.metrics.admission(Webhook::Mutate, &v);
        v
    }

    fn namespace(req: &AdmissionRequest, meta_ns: Option<&String>) -> Result<String, Verdict> {
        req.namespace
            .clone()
            .filter(|n| !n.is_empty())
            .or_else(|| meta_ns.cloned())
            .ok_or_else(|| Verdict::deny(400, "the request names no namespace"))
    }

    /// The pod's charge, or the templates it waits for; `Err` with the verdict to answer when
    /// it cannot be computed (a template that cannot be read fails closed).
    async fn price_pod(&self, ns: &str, pod: &Pod) -> Result<Priced, Verdict> {
        let mut templates = BTreeMap::new();
        let mut missing = Vec::new();
        for t in pod_template_names(pod) {
            match self.cluster.template(ns, &t).await {
                Ok(Some(spec)) => {
                    templates.insert(t, spec);
                }
                Ok(None) => missing.push(t),
                Err(e) => {
                    return Err(Verdict::deny(
                        500,
                        format!("cannot read ResourceClaimTemplate {ns}/{t} to charge the pod's GPU quota: {e}; try again"),
                    ))
                }
            }
        }
        if !missing.is_empty() {
            return Ok(Priced::WaitingFor(missing));
        }
        pod_charge(pod, &templates, &self.cluster.catalog())
            .map(Priced::Charge)
            .map_err(|e| {
                Verdict::deny(403, format!("cannot charge the pod against GPU quota: {e}"))
            })
    }

    async fn validate_pod_create(&self, req: &AdmissionRequest) -> Result<Verdict, Verdict> {
        let pod: Pod = decode(&req.object, "Pod")?;
        let ns = Self::namespace(req, pod.metadata.namespace.as_ref())?;
        let quotas = self.cluster.quotas_in(&ns);
        if quotas.is_empty() {
            return Ok(Verdict::allow());
        }
        let priced = self.price_pod(&ns, &pod).await?;
        if matches!(&priced, Priced::Charge(c) if c.is_empty()) {
            return Ok(Verdict::allow());
        }
        let name = pod
            .metadata
            .name
            .clone()
            .or_else(|| req.name.clone())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| Verdict::deny(400, "the pod has no name"))?;
        if let Some(m) = kueue::managed(&pod) {
            return match self.opts.kueue {
                // Kueue governs it: no charge, no queue, no owner-label rule of ours.
                true => Ok(Verdict::allow()),
                false => Err(Verdict::deny(
                    403,
                    kueue_contradiction(&ns, &name, &m, &quotas),
                )),
            };
        }
        // Before anything is charged or queued, in either mode.
        let charge = match &priced {
            Priced::Charge(c) => Some(c),
            Priced::WaitingFor(_) => None,
        };
        if let Some(why) = owner_refusal(
            quotas.iter().map(|q| &**q),
            &format!("{ns}/{name}"),
            pod.metadata.labels.as_ref(),
            charge,
        ) {
            return Err(Verdict::deny(403, why));
        }
        let charge = match priced {
            Priced::Charge(c) => c,
            // Charged nothing: held at the gate, it holds no devices until the controller
            // prices it from its templates and releases it.
            Priced::WaitingFor(missing) if has_gate(&pod) => {
                return Ok(Verdict::allow().with_warning(waiting_message(&ns, &missing)))
            }
            Priced::WaitingFor(missing) => {
                return Err(Verdict::deny(403, ungated_denial(&ns, &missing)))
            }
        };
        let reservation = Reservation {
            kind: ObjectKind::Pod,
            namespace: ns.clone(),
            name,
            uid: pod.metadata.uid.clone().filter(|u| !u.is_empty()),
            state: ReservationState::Reserved,
            charge: charge.usage.clone(),
            unpriced: charge
                .unknown
                .iter()
                .map(|u| format!("{}: {}", u.dimension, u.why))
                .collect(),
            priority: pod.spec.as_ref().and_then(|s| s.priority),
            since: now_rfc3339(),
        };
        let queue = quotas.iter().any(|q| q.spec.mode == QuotaMode::Queue);
        if queue && has_gate(&pod) {
            return Ok(self
                .queue(&quotas, reservation, req.dry_run == Some(true))
                .await);
        }
        self.reserve(&quotas, reservation, &charge, req.dry_run == Some(true))
            .await
    }

    fn validate_pod_update(&self, req: &AdmissionRequest) -> Result<Verdict, Verdict> {
        let new: Pod = decode(&req.object, "Pod")?;
        let old: Pod = decode(&req.old_object, "old Pod")?;
        if !has_gate(&old) || has_gate(&new) {
            return Ok(Verdict::allow());
        }
        let ns = Self::namespace(req, new.metadata.namespace.as_ref())?;
        // In Reject mode too: a pod waiting for its template is held by the gate.
        let governed = !self.cluster.quotas_in(&ns).is_empty();
        if !governed || self.opts.controller_users.contains(&req.user_info.username) {
            return Ok(Verdict::allow());
        }
        Err(Verdict::deny(
            403,
            format!(
                "the scheduling gate {SCHEDULING_GATE} is removed by the gpuplane controller when the pod's GpuQuota admits it; {} may not remove it",
                req.user_info.username
            ),
        ))
    }

    async fn validate_claim_create(&self, req: &AdmissionRequest) -> Result<Verdict, Verdict> {
        let claim: ResourceClaim = decode(&req.object, "ResourceClaim")?;
        let ns = Self::namespace(req, claim.metadata.namespace.as_ref())?;
        let user = req.user_info.username.as_str();
        if (claim_is_pod_owned(&claim.metadata) && CLAIM_CONTROLLER_USERS.contains(&user))
            || (claim_is_extended_resource_claim(&claim.metadata) && user == SCHEDULER_USER)
        {
            return Ok(Verdict::allow());
        }
        let quotas = self.cluster.quotas_in(&ns);
        if quotas.is_empty() {
            return Ok(Verdict::allow());
        }
        let charge = claim_charge(&claim.spec, &self.cluster.catalog()).map_err(|e| {
            Verdict::deny(
                403,
                format!("cannot charge the claim against GPU quota: {e}"),
            )
        })?;
        if charge.is_empty() {
            return Ok(Verdict::allow());
        }
        let name = claim
            .metadata
            .name
            .clone()
            .or_else(|| req.name.clone())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| Verdict::deny(400, "the claim has no name"))?;
        let reservation = Reservation {
            kind: ObjectKind::ResourceClaim,
            namespace: ns,
            name,
            uid: claim.metadata.uid.clone().filter(|u| !u.is_empty()),
            state: ReservationState::Reserved,
            charge: charge.usage.clone(),
            unpriced: Vec::new(),
            priority: None,
            since: now_rfc3339(),
        };
        self.reserve(&quotas, reservation, &charge, req.dry_run == Some(true))
            .await
    }

    /// Reserves `charge` in every quota; all or nothing. Each quota's reservation goes
    /// through its group commit ([`Committer`]): answered once durably written.
    async fn reserve(
        &self,
        quotas: &[Arc<GpuQuota>],
        reservation: Reservation,
        charge: &Charge,
        dry_run: bool,
    ) -> Result<Verdict, Verdict> {
        let key = reservation.key();
        let mut done: Vec<String> = Vec::new();
        for q in quotas {
            let Some(name) = q.metadata.name.clone() else {
                continue;
            };
            let op = if dry_run {
                Op::Check {
                    key: key.clone(),
                    charge: charge.clone(),
                }
            } else {
                Op::Reserve {
                    reservation: reservation.clone(),
                    charge: charge.clone(),
                    retreat: false,
                }
            };
            let verdict = match self.commit.submit(&key.namespace, &name, op).await {
                Answer::Fits(_) => {
                    done.push(name);
                    continue;
                }
                // Deleted since the cache saw it: it no longer applies.
                Answer::Gone => continue,
                Answer::Denied(denial) => {
                    if !dry_run {
                        self.metrics.quota_denied(&key.namespace, &name);
                    }
                    Verdict::deny(403, denial.to_string())
                }
                // Retryable: 429 makes clients (and controllers) back off and try again.
                Answer::Backpressure(why) => {
                    tracing::info!(key = %key, quota = %name, "reservation list full; refused for now");
                    Verdict::deny(429, why)
                }
                Answer::Failed(e @ CommitError::Contended { .. }) => {
                    self.metrics.contended();
                    Verdict::deny(429, format!("{e}; try again"))
                }
                Answer::Failed(e) => {
                    Verdict::deny(500, format!("cannot reserve GPU quota: {e}; try again"))
                }
                Answer::Queued | Answer::Released => Verdict::deny(
                    500,
                    format!("cannot reserve GPU quota: GpuQuota {}/{name} answered out of turn; try again", key.namespace),
                ),
            };
            if !dry_run {
                self.release(&key, &done);
            }
            return Err(verdict);
        }
        if !dry_run {
            for name in &done {
                self.metrics.quota_admitted(&key.namespace, name);
            }
        }
        Ok(Verdict::allow())
    }

    /// Best effort, not waited for: stale reservations are also collected by the controller.
    fn release(&self, key: &ReservationKey, quotas: &[String]) {
        for name in quotas {
            self.commit
                .submit_detached(&key.namespace, name, Op::Release { key: key.clone() });
        }
    }

    /// Records a gated pod as queued in every quota (best effort) and allows it.
    async fn queue(
        &self,
        quotas: &[Arc<GpuQuota>],
        reservation: Reservation,
        dry_run: bool,
    ) -> Verdict {
        if dry_run {
            return Verdict::allow();
        }
        let mut failed = Vec::new();
        for q in quotas {
            let Some(name) = q.metadata.name.clone() else {
                continue;
            };
            let op = Op::Queue {
                reservation: reservation.clone(),
            };
            match self.commit.submit(&reservation.namespace, &name, op).await {
                Answer::Queued | Answer::Gone => {}
                other => {
                    tracing::warn!(key = %reservation.key(), quota = %q.id(), answer = ?other, "recording a queued pod failed; the gate still holds it");
                    failed.push(q.id());
                }
            }
        }
        let v = Verdict::allow();
        if failed.is_empty() {
            v
        } else {
            v.with_warning(format!("queued for GPU quota; recording it in GpuQuota {} failed and will be retried by the controller", failed.join(", ")))
        }
    }

    async fn mutate_pod_create(&self, req: &AdmissionRequest) -> Result<Verdict, Verdict> {
        let pod: Pod = decode(&req.object, "Pod")?;
        let ns = Self::namespace(req, pod.metadata.namespace.as_ref())?;
        let quotas = self.cluster.quotas_in(&ns);
        let queue = quotas.iter().any(|q| q.spec.mode == QuotaMode::Queue);
        let Some(spec) = &pod.spec else {
            return Ok(Verdict::allow());
        };
        if quotas.is_empty()
            || has_gate(&pod)
            || kueue::managed(&pod).is_some()
            || spec.node_name.as_deref().is_some_and(|n| !n.is_empty())
        {
            return Ok(Verdict::allow());
        }
        let (gated, warning) = match self.price_pod(&ns, &pod).await {
            Ok(Priced::Charge(c)) => (queue && !c.is_empty(), None),
            // In any mode: it waits at the gate for its templates.
            Ok(Priced::WaitingFor(missing)) => (true, Some(waiting_message(&ns, &missing))),
            // Unpriceable: gate it; the validating webhook says why if it must deny.
            Err(_) => (queue, None),
        };
        if !gated {
            return Ok(Verdict::allow());
        }
        let gate = json!({"name": SCHEDULING_GATE});
        // Append to the pod's gates, or create the list with ours.
        let (path, value) = if spec.scheduling_gates.is_some() {
            (["spec", "schedulingGates", "-"].as_slice(), gate)
        } else {
            (["spec", "schedulingGates"].as_slice(), json!([gate]))
        };
        let op = PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(path.iter().copied()),
            value,
        });
        let v = Verdict::allow().with_patch(Patch(vec![op]));
        Ok(match warning {
            Some(w) => v.with_warning(w),
            None => v,
        })
    }
}
