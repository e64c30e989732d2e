//! gpuplane's cluster side: the GPU quota admission webhook and the controller around it
//! (queueing with scheduling gates, pod groups, preemption, the GPU-hours ledger, the "why
//! Pending" answer), the CLI's reads of the same (`explain`), and the watch-fed caches both
//! keep of the cluster's GPUs (`published`, `reflect`). The pure rules are `gpuplane-model`'s;
//! here is everything that touches the API server or serves HTTPS. ARCHITECTURE.md has the
//! codemap.

#![forbid(unsafe_code)]
// No panics on what a user, peer or file can influence: a check, not a habit (unit tests exempt).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod controller;
pub mod controller_metrics;
pub mod elector;
pub mod explain_cli;
pub mod published;
pub mod reflect;
pub mod replica;
pub mod webhook;

// The shared edges and the pure core keep their names inside this crate.
use gpuplane_common::{backoff, httpserve, metrics};
use gpuplane_model::quota;
