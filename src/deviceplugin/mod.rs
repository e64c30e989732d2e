//! The kubelet device plugin API (v1beta1): which resources the node offers (`resources`), the
//! Allocate and preferred-allocation decisions (`allocate`), and the thin gRPC shell around them
//! (`service`, `registrar`).

pub mod allocate;
pub mod registrar;
pub mod resources;
pub mod service;
