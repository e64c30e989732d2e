//! The GpuQuota custom resource (`quota.gpuplane.dev/v1alpha1`, namespaced, with a status
//! subresource). `daemonset/controller/crd.yaml` is generated from these types
//! (`GpuQuota::crd()`); a test keeps the two equal.

use super::preemption::PreemptionPolicy;
use super::usage::{Limits, Usage};
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of GpuQuota.
pub const GROUP: &str = "quota.gpuplane.dev";
/// API version of GpuQuota.
pub const VERSION: &str = "v1alpha1";
/// `group/version`.
pub const API_VERSION: &str = "quota.gpuplane.dev/v1alpha1";
/// Plural resource name.
pub const PLURAL: &str = "gpuquotas";
/// The scheduling gate Queue mode puts on pods; the controller removes it on admission.
pub const SCHEDULING_GATE: &str = "quota.gpuplane.dev/admission";

/// A limit on the GPUs the pods and ResourceClaims of one namespace may hold.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "quota.gpuplane.dev",
    version = "v1alpha1",
    kind = "GpuQuota",
    plural = "gpuquotas",
    shortname = "gq",
    namespaced,
    status = "GpuQuotaStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name": "Mode", "type": "string", "jsonPath": ".spec.mode"}"#,
    printcolumn = r#"{"name": "Cohort", "type": "string", "jsonPath": ".spec.cohort"}"#,
    printcolumn = r#"{"name": "GPUs", "type": "string", "jsonPath": ".status.used.gpus"}"#,
    printcolumn = r#"{"name": "Memory", "type": "string", "jsonPath": ".status.used.gpuMemory"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.temporary) || self.temporary.all(t, (!has(t.hard.gpus) || has(self.hard.gpus)) && (!has(t.hard.gpuMemory) || has(self.hard.gpuMemory)) && (!has(t.hard.devices) || t.hard.devices.all(k, has(self.hard.devices) && k in self.hard.devices)))",
        "message": "spec.temporary: a raise may only add to a dimension spec.hard limits (gpus, gpuMemory, or a device name in spec.hard.devices); limit it in spec.hard first"
    },
    {
        "rule": "!has(self.temporary) || self.temporary.all(t, has(t.hard.gpus) || has(t.hard.gpuMemory) || (has(t.hard.devices) && size(t.hard.devices) > 0))",
        "message": "spec.temporary: each raise must raise at least one of gpus, gpuMemory or devices"
    }
]))]
pub struct GpuQuotaSpec {
    /// Upper bounds; any subset of gpus, gpuMemory and devices. A dimension left out is not
    /// limited.
    pub hard: Limits,
    /// Reject: a pod or claim that does not fit is denied at admission. Queue: GPU pods get the
    /// scheduling gate `quota.gpuplane.dev/admission` and are admitted in turn by the
    /// controller.
    #[serde(default)]
    pub mode: QuotaMode,
    /// GpuQuotas with the same cohort may borrow each other's unused quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cohort: Option<String>,
    /// The most this quota may borrow from its cohort beyond `hard`, per dimension; a dimension
    /// left out (or no borrowingLimit at all) may borrow whatever the cohort has unused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub borrowing_limit: Option<Limits>,
    /// Label keys every GPU pod of the namespace must carry with a non-empty value (e.g.
    /// `team`, `cost-center`), so that what it uses has an owner; a GPU pod lacking one is
    /// refused at admission, naming it. At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::owners::label_keys_schema")]
    pub require_labels: Vec<String>,
    /// Raises of `hard` that end at a given time (a launch, an incident): each adds its `hard`
    /// to `spec.hard` until `expires`; after that new admissions see the base again and
    /// what runs keeps running. Only dimensions `spec.hard` limits can be raised.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub temporary: Vec<TemporaryRaise>,
    /// Queue mode: whether a waiting pod may have others evicted to make room (see
    /// docs/quota.md). Left out: never.
    #[serde(default, skip_serializing_if = "is_default")]
    pub preemption: PreemptionPolicy,
}

fn is_default<T: Default + PartialEq>(t: &T) -> bool {
    *t == T::default()
}

/// What happens to a pod or claim that does not fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum QuotaMode {
    #[default]
    Reject,
    Queue,
}

/// The kind of object a reservation is for.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub enum ObjectKind {
    Pod,
    ResourceClaim,
}

/// Whether a reservation counts against the quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReservationState {
    /// Admitted, not yet counted in `used`: counts against `hard`.
    Reserved,
    /// Gated in Queue mode, waiting for admission: does not count.
    Queued,
}

/// One admitted-but-not-yet-running (or queued) pod or claim.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Reservation {
    pub kind: ObjectKind,
    pub namespace: String,
    pub name: String,
    /// The object's uid as the validating webhook saw it, when it had one; reservations are
    /// keyed without it (kind, namespace, name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    pub state: ReservationState,
    /// What was charged (the worst case at admission).
    pub charge: Usage,
    /// Dimensions that could not be priced at admission, and why (Queue mode records them;
    /// the controller re-prices before admitting).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unpriced: Vec<String>,
    /// The pod's priority, for queue order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// When it was recorded (RFC 3339).
    pub since: String,
}

/// Headroom one webhook replica holds (escrow, see [`super::escrow`]): counted against `hard`
/// as if consumed, so the replica may admit within it without a status write per admission.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Escrow {
    /// The replica process holding it (its identity and a per-process nonce).
    pub holder: String,
    /// What it holds: its admissions not yet recorded as reservations, and what it may still
    /// admit.
    pub amount: Usage,
    /// When the holder last wrote it (RFC 3339); the controller drops an escrow not renewed
    /// for the reservation grace.
    pub renewed: String,
}

/// A status condition, shaped as metav1.Condition.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaCondition {
    #[serde(rename = "type")]
    pub type_: String,
    /// True, False or Unknown.
    pub status: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_transition_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// What the quota holds now.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuQuotaStatus {
    /// Charged for the pods the controller sees (every pod not finished and not at the admission
    /// gate, scheduled or not) and allocated claims; written by the controller, which removes
    /// their reservations in the same write.
    #[serde(default)]
    pub used: Usage,
    /// Sum of the `Reserved` reservations: admitted, not yet seen by the controller.
    #[serde(default)]
    pub reserved: Usage,
    /// Sum of the `Queued` reservations: gated, waiting.
    #[serde(default)]
    pub queued: Usage,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reservations: Vec<Reservation>,
    /// Headroom held by webhook replicas; counts against `hard`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub escrows: Vec<Escrow>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<QuotaCondition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Each of `spec.temporary` as the controller last saw it (in force, expired, invalid).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub temporary: Vec<RaiseStatus>,
    /// GPU time the namespace's pods used this calendar month, as the GPU-hours ledger has
    /// counted it so far (written by the controller; see docs/gpu-hours.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_hours: Option<GpuHoursStatus>,
}

impl GpuQuota {
    /// `namespace/name`.
    pub fn id(&self) -> String {
        format!(
            "{}/{}",
            self.metadata.namespace.as_deref().unwrap_or(""),
            self.metadata.name.as_deref().unwrap_or("")
        )
    }

    /// The status, or an empty one.
    pub fn status_or_default(&self) -> GpuQuotaStatus {
        self.status.clone().unwrap_or_default()
    }
}

/// A GpuQuota's GPU time in the current period (`status.gpuHours`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuHoursStatus {
    /// The calendar month (UTC), `YYYY-MM`.
    pub period: String,
    /// Whole-GPU-equivalent seconds (MIG slices and shares as their fraction of a GPU).
    pub gpu_seconds: f64,
    /// GPU memory bytes times seconds.
    pub gpu_memory_byte_seconds: f64,
    /// Utilization-weighted GPU-seconds the governed pods' GPUs were busy (from the agents'
    /// telemetry through Prometheus); absent when the controller has no `--prometheus-url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy_gpu_seconds: Option<f64>,
    /// The most GPU memory one governed pod used at once, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_gpu_memory_bytes: Option<f64>,
    /// How far busy time and peak memory are counted (RFC 3339); they trail `gpuSeconds` while
    /// Prometheus cannot be reached, then catch up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy_counted_until: Option<String>,
}

/// More `hard` for a while.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemporaryRaise {
    /// Added to `spec.hard` per dimension; only a dimension `spec.hard` limits can be raised.
    pub hard: Limits,
    /// When the raise ends (RFC 3339, e.g. `2026-12-31T18:00:00Z`).
    #[schemars(schema_with = "date_time_schema")]
    pub expires: String,
    /// Why, and who asked: shown in the quota's condition and Events.
    #[schemars(length(min = 1, max = 256))]
    pub reason: String,
}

fn date_time_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "string", "format": "date-time", "maxLength": 64})
}

/// Where a raise stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum RaiseState {
    InForce,
    Expired,
    /// `expires` is not an RFC 3339 time (the CRD's schema refuses that; an older one may
    /// not have): never in force.
    Invalid,
}

/// One raise as the controller last saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RaiseStatus {
    pub reason: String,
    pub expires: String,
    pub state: RaiseState,
}
