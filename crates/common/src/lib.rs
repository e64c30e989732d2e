//! What gpuplane's node agent (`gpuplane-node`) and cluster side (`gpuplane-cluster`) truly
//! share, and nothing else: the kube client set-up, the metrics registry helpers, HTTP(S)
//! serving and the one backoff. Neither product crate may depend on the other
//! (tests/it/architecture.rs); what both need comes down here.

#![forbid(unsafe_code)]
// No panics on what a user, peer or file can influence: a check, not a habit (unit tests exempt).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod backoff;
pub mod httpserve;
pub mod kubeclient;
pub mod metrics;
