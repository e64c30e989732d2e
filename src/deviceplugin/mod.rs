//! The kubelet device plugin API (v1beta1): resources, Allocate, preferred allocation, and the
//! gRPC service and registration shell around them.

pub mod resources;
