//! Why a namespace's reconcile failed, and when the loop tries it again.

use crate::quota::QuotaMathError;
use gpuplane_model::report::chain;
use std::time::Duration;

/// Why a namespace's reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// An API call failed.
    #[error("{op} {object}: {}", chain(.cause))]
    Api {
        op: &'static str,
        object: String,
        cause: Box<kube::Error>,
    },
    /// A GpuQuota changed between our read and our write; the namespace is planned again.
    #[error("GpuQuota {0} changed while being written")]
    Conflict(String),
    /// Quota arithmetic overflowed.
    #[error("namespace {namespace}: {}", chain(.cause))]
    Math {
        namespace: String,
        cause: QuotaMathError,
    },
}

/// When to reconcile a namespace again after its `failures`-th consecutive failure.
pub fn error_policy(error: &QueueError, failures: u32) -> Duration {
    // The first retry already waits twice the base.
    let exp = |base_ms: u64, cap: Duration| {
        crate::backoff::after(
            Duration::from_millis(base_ms),
            cap,
            failures.saturating_add(1),
        )
    };
    match error {
        QueueError::Conflict(_) => exp(10, Duration::from_secs(2)),
        QueueError::Api { .. } => exp(200, Duration::from_secs(30)),
        QueueError::Math { .. } => Duration::from_secs(60),
    }
}

pub(super) fn api_error(op: &'static str, object: &str, e: kube::Error) -> QueueError {
    QueueError::Api {
        op,
        object: object.into(),
        cause: Box::new(e),
    }
}
