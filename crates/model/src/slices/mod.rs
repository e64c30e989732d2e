//! ResourceSlices, the pure half: what this node offers to the DRA scheduler.
//!
//! - [`mod@render`] (pure): inventory + health -> the `resource.k8s.io/v1` ResourceSlices of this
//!   node's pool, with NVIDIA-compatible attribute names, taints for unhealthy devices and a
//!   deterministic split into slices.
//! - [`mod@validate`] (pure): the API server's ResourceSlice validation rules, so a bad slice is
//!   caught in tests and before a write, with the field paths the API server would name, and
//!   the scheduler's rules for a whole pool (counter sets and the devices consuming them).
//! - [`plan`] (pure): existing + desired slices -> the creates, updates and deletes to make,
//!   and the pool generation.
//!
//! The publisher that keeps the API server in step is the product's `slices::publisher`.

pub mod plan;
pub mod render;
pub mod validate;

pub use render::{render, render_with_generation, slice_name, UNHEALTHY_TAINT_KEY};
pub use validate::{validate, validate_pool, Problem, Violation};

/// Most devices in one ResourceSlice (`resource.ResourceSliceMaxDevices`).
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Most devices in one ResourceSlice when any of them has taints or consumes counters.
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS: usize = 64;
/// Most counter sets in one ResourceSlice (`resource.ResourceSliceMaxCounterSets`, 1.37).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// Most counters in one counter set (`resource.ResourceSliceMaxCountersPerCounterSet`).
pub const MAX_COUNTERS_PER_SET: usize = 32;
/// Most attributes and capacities, together, on one device.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Longest string or version attribute value.
pub const MAX_ATTRIBUTE_VALUE_LEN: usize = 64;

#[cfg(test)]
mod dynamic_tests;
#[cfg(test)]
mod tests;
