//! gpuplane's pure core: what a node has and how it is shared, as plain data and plain
//! functions. Inventory, topology scoring, health, the allocation ledger, one Kubernetes
//! `Quantity`, quota arithmetic, the device plugin's resource plans and decisions, claim
//! planning, and the rendering of CDI specs, ResourceSlices and node labels. Nothing here does
//! network I/O or waits on a runtime: the product crate (`gpuplane`) holds the shells. The
//! only file I/O is reading simulation profiles and the agent config a caller names.

#![forbid(unsafe_code)]
// No panics on what a user, peer or file can influence: a check, not a habit (unit tests exempt).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

#[macro_use]
mod newtype;

pub mod cdi;
pub mod config;
pub mod controller;
pub mod deviceplugin;
pub mod dra;
pub mod dynamic_mig;
pub mod explain;
pub mod gpu_select;
pub mod health;
pub mod inventory;
pub mod kueue;
pub mod labels;
pub mod ledger;
pub mod mps_pod;
pub mod names;
pub mod quantity;
pub mod quota;
pub mod report;
pub mod sharing;
pub mod sim;
pub mod slices;
pub mod source;
pub mod telemetry;
pub mod topology;
