//! CDI (Container Device Interface) specs, the pure half: the file format and cdiVersion rules
//! ([`spec`]: emit the lowest version that fits; podman 4.3 reads at most 0.5.0), validated
//! kinds and names ([`name`]), the hook that holds a share to its memory ([`memory_limit`]), what a driver installation offers a spec ([`files`]), and the
//! rendering of the node spec and of per-claim specs ([`render`]).
//!
//! A spec rendered while [`DriverFiles::node_problems`] is non-empty must not be written or
//! cached: a container started from it would lack `/dev/nvidia*` (or get the wrong device).
//! [`DeviceNodesError`] is the refusal meanwhile.
//!
//! Simulated devices (`gpuplane node --simulate`) have no device nodes and no driver files:
//! [`render::render_simulated_spec`] gives each device its identity in the environment instead
//! (`GPUPLANE_DEVICE_<key>=index=…,uuid=…,profile=…`, see [`render::device_env`]), so a
//! container on a cluster without GPUs starts and can see what it was given.

pub mod files;
pub mod memory_limit;
pub mod name;
pub mod render;
pub mod spec;

pub use files::{
    DeviceNodesError, DriverFiles, DriverInstall, Expected, Found, HostFile, MigCap, NodeFault,
    NodeProblem,
};
pub use memory_limit::MemoryLimitHook;
pub use name::{DeviceName, Kind, NameError, QualifiedName};
pub use render::{
    render_node_spec, render_simulated_node_spec, render_simulated_spec, render_spec, DeviceRef,
    NamedDevices,
};
pub use spec::{minimum_version, ContainerEdits, Device, DeviceNode, Hook, Mount, Spec};
