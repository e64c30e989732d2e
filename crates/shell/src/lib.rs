//! gpuplane's shells: the node agent (kubelet device plugin + DRA driver from one inventory)
//! and the cluster-side GPU quota controller, around the pure core in `gpuplane-model`. Here
//! is everything that touches a socket, a file, NVML or the API server. ARCHITECTURE.md has
//! the codemap.

// Unsafe code is refused everywhere but at the NVML edge (`nvml/raw.rs`); the model crate
// forbids it outright.
#![deny(unsafe_code)]
// No panics on what a user, peer or file can influence: a check, not a habit (unit tests exempt).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod backoff;
pub mod cdi;
pub mod controller;
pub mod crashpoint;
pub mod deviceplugin;
pub mod discover;
pub mod dra;
pub mod explain;
pub mod fsutil;
pub mod grpc;
pub mod httpserve;
pub mod kubeclient;
pub mod metrics;
pub mod mps;
pub mod node;
pub mod nvml;
pub mod paths;
pub mod proto;
pub mod published;
pub mod reflect;
pub mod slices;
pub mod webhook;

// The pure core lives in its own crate, so nothing there can reach a socket, a runtime or
// NVML; its modules keep their names here.
pub use gpuplane_model::{
    causes_from, config, health, inventory, labels, ledger, mps_pod, names, quantity, quota,
    report, sharing, sim, source, topology,
};
