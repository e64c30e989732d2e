//! gpuplane: a Kubernetes GPU node agent (kubelet device plugin + DRA driver from one inventory)
//! and a cluster-side GPU quota controller. ARCHITECTURE.md has the codemap.

// Unsafe code is refused everywhere but at the NVML edge (`nvml/raw.rs`); the model crate
// forbids it outright.
#![deny(unsafe_code)]

pub mod cdi;
pub mod controller;
pub mod crashpoint;
// The demo and the test doubles it runs on (API server, kubelet, labs): the default build has
// them, the image's (`--no-default-features`) does not.
#[cfg(feature = "demo")]
pub mod demo;
pub mod deviceplugin;
pub mod discover;
#[cfg(feature = "demo")]
pub mod doubles;
pub mod dra;
pub mod fsutil;
pub mod fuzzing;
pub mod grpc;
pub mod httpserve;
pub mod kubeclient;
pub mod metrics;
pub mod node;
pub mod nvml;
pub mod proto;
pub mod slices;
pub mod webhook;

// The pure core lives in its own crate, so nothing there can reach a socket, a runtime or
// NVML; its modules keep their names here.
pub use gpuplane_model::{
    config, health, inventory, labels, ledger, quantity, quota, sim, source, topology,
};
