//! Read-modify-write of a GpuQuota's status with optimistic concurrency (I/O shell).
//!
//! GET the quota, let a pure function decide, PUT `/status` with the resourceVersion that was
//! read; on 409 Conflict read again and decide again, as Kubernetes' ResourceQuota admission
//! does. Any number of writers (webhook replicas, the controller) stay exact: a decision is
//! only written against the state it was made on.

use super::crd::GpuQuota;
use kube::api::{Api, PostParams};
use std::time::{Duration, Instant};

/// What the decision function wants done with the quota it was given.
#[derive(Debug)]
pub enum Step<T> {
    /// Write the (changed) quota's status, then return `T`.
    Write(T),
    /// Nothing to write; return `T`.
    Done(T),
}

#[derive(Debug, thiserror::Error)]
pub enum UpdateError<E: std::fmt::Display> {
    /// The decision function refused (e.g. a denial).
    #[error("{0}")]
    Rejected(E),
    #[error("GpuQuota {quota}: {source}")]
    Api {
        quota: String,
        #[source]
        source: kube::Error,
    },
    #[error("GpuQuota {quota}: still conflicting after {attempts} attempts in {elapsed:?}")]
    Contended {
        quota: String,
        attempts: u32,
        elapsed: Duration,
    },
}

/// Retry bounds for [`update_status`].
#[derive(Debug, Clone, Copy)]
pub struct RetryBudget {
    pub max_attempts: u32,
    /// Give up after this long (keep it under the webhook's timeout).
    pub deadline: Duration,
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget {
            max_attempts: 200,
            deadline: Duration::from_secs(8),
        }
    }
}

/// Reads quota `name` through `api`, applies `decide`, and writes the status when asked,
/// retrying on conflicts within `budget`.
pub async fn update_status<T, E, F>(
    api: &Api<GpuQuota>,
    name: &str,
    budget: RetryBudget,
    mut decide: F,
) -> Result<T, UpdateError<E>>
where
    E: std::fmt::Display,
    F: FnMut(&mut GpuQuota) -> Result<Step<T>, E>,
{
    let start = Instant::now();
    let api_err = |source| UpdateError::Api {
        quota: name.to_string(),
        source,
    };
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let mut quota = api.get(name).await.map_err(api_err)?;
        match decide(&mut quota).map_err(UpdateError::Rejected)? {
            Step::Done(t) => return Ok(t),
            Step::Write(t) => match api
                .replace_status(name, &PostParams::default(), &quota)
                .await
            {
                Ok(_) => return Ok(t),
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(api_err(e)),
            },
        }
        if attempt >= budget.max_attempts || start.elapsed() >= budget.deadline {
            return Err(UpdateError::Contended {
                quota: name.to_string(),
                attempts: attempt,
                elapsed: start.elapsed(),
            });
        }
        // A little jitter spreads competing writers apart.
        let jitter =
            u64::from(start.elapsed().subsec_nanos() % 5_000) + u64::from(attempt.min(20)) * 200;
        tokio::time::sleep(Duration::from_micros(jitter)).await;
    }
}
