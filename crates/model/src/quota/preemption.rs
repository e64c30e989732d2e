//! A GpuQuota's preemption policy (`spec.preemption`), in Kueue's spirit: whether a waiting
//! pod may have lower-priority pods of its own quota evicted, and whether it may reclaim what
//! other quotas of its cohort borrowed. Queue mode only: Reject mode never preempts. The
//! decision itself is `crate::controller::preempt`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `spec.preemption`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreemptionPolicy {
    /// Whether a waiting pod may evict pods of its own quota: `LowerPriority` (only pods of
    /// strictly lower priority) or `Never` (the default).
    #[serde(default)]
    pub within_quota: WithinQuota,
    /// Whether a waiting pod may evict pods of other quotas of its cohort that run on capacity
    /// borrowed from this one: `Any`, `LowerPriority` or `Never` (the default).
    #[serde(default)]
    pub reclaim_within_cohort: ReclaimWithinCohort,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum WithinQuota {
    LowerPriority,
    #[default]
    Never,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReclaimWithinCohort {
    Any,
    LowerPriority,
    #[default]
    Never,
}

impl PreemptionPolicy {
    /// Whether this policy ever preempts.
    pub fn preempts(&self) -> bool {
        self.within_quota != WithinQuota::Never
            || self.reclaim_within_cohort != ReclaimWithinCohort::Never
    }
}
