//! Test doubles of gpuplane's peers, following their real semantics: used by the integration
//! tests and by `gpuplane demo`, which runs the whole story without a cluster. Nothing in the
//! agent itself depends on this module.

pub mod admission;
pub mod apiserver;
pub mod claims;
pub mod devnodes;
pub mod dial;
pub mod kubelet;
pub mod kubelet_dra;
pub mod lab;
pub mod pod_runner;
pub mod stall;
