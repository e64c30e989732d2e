//! GPU quota: the GpuQuota resource and the pure arithmetic of charging pods and claims
//! against it. The webhook (`crate::webhook`) and the controller loops build on this.
//!
//! # API overview (stable; for the controller loops)
//!
//! Types
//! - [`GpuQuota`] / [`GpuQuotaSpec`] / [`GpuQuotaStatus`] (kube `CustomResource`,
//!   `quota.gpuplane.dev/v1alpha1`, namespaced, status subresource): `Api<GpuQuota>` works.
//!   `spec.hard: `[`Limits`], `spec.mode: `[`QuotaMode`] (`Reject` | `Queue`), `spec.cohort`,
//!   `spec.borrowingLimit: Limits`, `spec.requireLabels` (owner label keys, [`owners`]),
//!   `spec.temporary: Vec<`[`TemporaryRaise`]`>` (raises of `hard` until a time: deciders take [`GpuQuotaSpec::in_force`]`(now)`). Status: `used`, `reserved`, `queued` ([`Usage`]),
//!   `reservations: Vec<`[`Reservation`]`>`, `conditions: Vec<`[`QuotaCondition`]`>`.
//! - [`Gpus`]: exact fraction of whole GPUs (`1/7`), [`Memory`]: bytes, [`Usage`]: the three
//!   dimensions, [`Dimension`] / [`Amount`]: one of them.
//! - [`Charge`]: a [`Usage`] plus the dimensions that could not be priced ([`UnknownCharge`]).
//! - [`ReservationKey`]: (kind, namespace, name), no uid. [`SCHEDULING_GATE`] is
//!   `quota.gpuplane.dev/admission`.
//! - [`DeviceCatalog`]: devices from ResourceSlices + DeviceClasses, built with
//!   [`DeviceCatalog::new`]`(&slices, &classes, `[`CatalogSettings`]`)`.
//!
//! Pricing (pure)
//! - [`pod_charge`]`(&pod, &templates, &catalog)`: a pod's worst-case charge (device-plugin
//!   resources with the init-container rule + claims from templates; fetch the templates named
//!   by [`pod_template_names`] first). [`Charge::is_empty`] means "not a GPU pod".
//! - [`claim_charge`]`(&claim.spec, &catalog)`: a claim's worst case before allocation.
//! - [`settled_claim_charge`]`(&claim, &catalog)`: the actual charge from
//!   `status.allocation` (`Ok(None)` while unallocated; keep the worst case while it has
//!   unknowns).
//! - Shares (`share.rs`, DRA consumable capacity): a device with `allowMultipleAllocations`
//!   ([`CatalogDevice::multi_allocatable`], its `memory`/`compute` [`ConsumableCapacity`]) is
//!   charged per share: `gpuMemory` what it consumes, `gpus` its `compute` over the device's
//!   (80 of 100 on a whole GPU is 4/5); [`allocation_charge`] prices one allocation on a device.
//! - [`missing_templates`]: templates a pod names that do not exist yet; such a pod is
//!   admitted gated and charged nothing until they do ([`template_wait`]).
//! - [`claim_is_pod_owned`]: claims made from a pod's template are charged through the pod;
//!   [`claim_is_extended_resource_claim`]: so are those the scheduler makes for a pod's
//!   `nvidia.com/gpu` served through DRA.
//!
//! Deciding (pure)
//! - [`owner_refusal`]`(&quotas, "ns/pod", labels, Some(&charge))`: why a GPU pod lacking a
//!   label some quota's `spec.requireLabels` names (or with it empty) is refused, before any
//!   check; None for a pod charged nothing.
//! - [`check()`]`(&quota, &all_quotas, Some(&key), &charge) -> Result<`[`Fit`]`, `[`Denial`]`>`:
//!   `used + reserved (minus key's own) + charge <= hard`, with cohort borrowing. `Denial`
//!   displays as `gpuMemory: requested 10Gi, used 15Gi of 20Gi in GpuQuota team-a/default`.
//!   [`borrowing`]`(&quota)`: what a quota consumes beyond its `hard`, per dimension.
//! - [`try_reserve`]: check and record a `Reserved` reservation; [`record_queued`]: record a
//!   `Queued` one. [`GpuQuotaStatus::admit_queued`] turns a queued one into reserved (the Queue
//!   loop: `check` it, `admit_queued`, write, then remove the gate);
//!   [`GpuQuotaStatus::queue_order`] lists queued ones (priority, then age);
//!   [`GpuQuotaStatus::release`], [`GpuQuotaStatus::upsert`],
//!   [`GpuQuotaStatus::consumed`], [`GpuQuotaStatus::recompute_totals`].
//! - [`stale_reservations`]`(&status, &live_by_key, now, grace)`: reservations to drop
//!   (object counted in `used`; or older than `grace` with no live object / another uid).
//!   [`DEFAULT_RESERVATION_GRACE`] is 2 minutes.
//! - [`MAX_RESERVATIONS`] bounds the reservation list (and so the status's size);
//!   [`GpuQuotaStatus::room`] is what is left of it. Past it [`decide_batch`] answers
//!   [`Outcome::Backpressure`] to an admission that needs a new entry.
//!
//! Group commit (pure): [`decide_batch`]`(&mut quota, &peers, &[`[`Op`]`])` decides every
//! admission waiting for one quota in order on one state ([`Decided`]: an [`Outcome`] per op,
//! and whether to write); [`stale_borrowers`] re-checks borrowing admissions against the
//! cohort read after the write.
//!
//! Contract with the controller: it sets `status.used` to the charges of the objects it counts
//! (every pod not finished and not at the admission gate, scheduled or not; allocated
//! standalone claims, [`settled_claim_charge`]) and
//! drops their reservations in the same write; it GCs with [`stale_reservations`]. A gated pod
//! of a Queue-mode quota that has no `Queued` reservation must still be treated as queued:
//! recording is best effort when the API server is unreachable, the gate is what holds it.
//! See docs/quota.md.

pub mod batch;
pub mod capacity;
pub mod catalog;
pub mod charge;
pub mod check;
pub mod clock;
pub mod crd;
pub mod escrow;
pub mod owners;
pub mod preemption;
pub mod ratio;
pub mod scope;
pub mod selector;
pub mod share;
pub mod status;
pub mod template_wait;
pub mod temporary;
pub mod usage;

pub use batch::{borrows, decide_batch, stale_borrowers, Decided, Op, Outcome};
pub use capacity::{ConsumableCapacity, RequestPolicy, ValidRange};
pub use catalog::{
    mig_share, CatalogDevice, CatalogSettings, ClassMatch, DeviceCatalog, DeviceFacts, DeviceKind,
    SliceDevices,
};
pub use charge::{
    claim_charge, claim_is_extended_resource_claim, claim_is_pod_owned, pod_charge,
    pod_resource_counts, pod_template_names, settled_claim_charge, ChargeError,
};
pub use check::{borrowing, check, check_consumed, record_queued, try_reserve, Denial, Fit};
pub use clock::now_rfc3339;
pub use crd::{
    Escrow, GpuHoursStatus, GpuQuota, GpuQuotaSpec, GpuQuotaStatus, ObjectKind, QuotaCondition,
    QuotaMode, Reservation, ReservationState, SCHEDULING_GATE,
};
pub use crd::{RaiseState, RaiseStatus, TemporaryRaise};
pub use owners::owner_refusal;
pub use preemption::{PreemptionPolicy, ReclaimWithinCohort, WithinQuota};
pub use ratio::{Gpus, QuotaMathError};
pub use scope::{claims_or_names, governs_pod};
pub use share::{allocation_charge, CapacityAmounts};
pub use status::{
    stale_reservations, LiveObject, ReservationKey, DEFAULT_RESERVATION_GRACE, MAX_RESERVATIONS,
};
pub use template_wait::{missing_templates, ungated_denial, waiting_message};
pub use temporary::{note_raises, RAISE_CONDITION};
pub use usage::{Amount, Charge, Dimension, Limits, Memory, UnknownCharge, Usage};

#[cfg(test)]
mod tests;
