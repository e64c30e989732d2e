//! gpuplane's node agent: the kubelet device plugin and DRA driver from one inventory, over
//! NVML, CDI spec files, MPS and the ResourceSlices it publishes. The pure rules are
//! `gpuplane-model`'s; here is everything on the node that touches a socket, a file, NVML or
//! the API server. ARCHITECTURE.md has the codemap.

// Unsafe code is refused everywhere but at the NVML edge (`nvml/raw.rs`); the model crate
// forbids it outright.
#![deny(unsafe_code)]
// No panics on what a user, peer or file can influence: a check, not a habit (unit tests exempt).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod cdi;
pub mod crashpoint;
pub mod deviceplugin;
pub mod discover;
pub mod doctor;
pub mod dra;
pub mod fsutil;
pub mod grpc;
pub mod kube_events;
pub mod metrics;
pub mod mps;
pub mod node;
pub mod nvml;
pub mod paths;
pub mod proto;
pub mod slices;
pub mod state;
pub mod telemetry;

// The shared edges and the pure core keep their names inside this crate.
use gpuplane_common::{backoff, httpserve};
use gpuplane_model::{config, health, inventory, labels, ledger, sharing, sim, source, topology};
