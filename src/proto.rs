//! Generated kubelet API bindings (work in progress).
