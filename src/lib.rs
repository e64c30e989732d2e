//! gpuplane: a Kubernetes GPU node agent (kubelet device plugin + DRA driver from one inventory)
//! and a cluster-side GPU quota controller. ARCHITECTURE.md has the codemap.

pub mod cdi;
pub mod config;
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
pub mod health;
pub mod httpserve;
pub mod inventory;
pub mod kubeclient;
pub mod labels;
pub mod ledger;
pub mod metrics;
pub mod node;
pub mod nvml;
pub mod proto;
pub mod quantity;
pub mod quota;
pub mod sim;
pub mod slices;
pub mod source;
pub mod topology;
pub mod webhook;
