//! The quota controller's decisions, pure: the release planner with the starvation rule
//! ([`plan`]), the quota model as the planner's ledger ([`quota_ledger`]), one namespace's decision
//! ([`namespace`]: status, releases, notes), what is read from a Pod ([`pods`]), and the
//! namespace label the mutating gate webhook selects on ([`queue_label`]), and leader
//! election's expiry and step-down rules ([`lease`]), the GPU-hours ledger's accounting
//! ([`hours`]), and whom a waiting unit may have evicted under its quotas' preemption policy
//! ([`preempt`]). The loops are the shell's `controller`.

pub mod hours;
pub mod lease;
pub mod namespace;
pub mod plan;
pub mod pods;
pub mod preempt;
pub mod queue_label;
pub mod quota_ledger;
