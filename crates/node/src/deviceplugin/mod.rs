//! The kubelet device plugin API (v1beta1): the thin gRPC shell (`service`, `registrar`)
//! around the pure decisions in `gpuplane_model::deviceplugin` (re-exported here): which
//! resources the node offers (`resources`) and the Allocate and preferred-allocation answers
//! (`allocate`).

pub use gpuplane_model::deviceplugin::*;

pub mod registrar;
pub mod service;
