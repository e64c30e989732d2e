//! CDI (Container Device Interface) specs: how containers get the GPUs the kubelet or DRA
//! allocated.
//!
//! - [`spec`]: the file format and the cdiVersion rules (emit the lowest version that fits;
//!   podman 4.3 reads at most 0.5.0);
//! - [`name`]: validated kinds, device names and qualified names (`nvidia.com/gpu=0`);
//! - [`driver`]: discovery of device nodes, driver libraries, binaries and the ldcache hook on
//!   the host (the only I/O besides writing);
//! - [`install`]: the driver-install scan, cached per driver root and driver version;
//! - [`render`]: pure rendering of the node spec (`nvidia.com/gpu`, the names NVIDIA's specs
//!   use) and of specs over arbitrary named device sets (DRA claims);
//! - [`writer`]: atomic, skip-if-identical writes of `<cdi root>/<stem>.json`.
//!
//! A spec rendered while [`DriverFiles::node_problems`] is non-empty must not be written or
//! cached: a container started from it would lack `/dev/nvidia*` (or get the wrong device).
//! Render again once the nodes are right. [`DeviceNodesError`] is the refusal meanwhile.
//!
//! Simulated devices (`gpuplane node --simulate`) have no device nodes and no driver files:
//! [`render::render_simulated_spec`] gives each device its identity in the environment instead
//! (`GPUPLANE_DEVICE_<key>=index=…,uuid=…,profile=…`, see [`render::device_env`]), so a
//! container on a cluster without GPUs starts and can see what it was given.

pub mod driver;
pub mod install;
pub mod name;
pub mod render;
pub mod spec;
pub mod writer;

pub use driver::{
    DeviceNodesError, DriverFiles, DriverInstall, Expected, Found, HostFile, MigCap, NodeFault,
    NodeProblem, ProcCaps,
};
pub use install::InstallCache;
pub use name::{DeviceName, Kind, NameError, QualifiedName};
pub use render::{
    render_node_spec, render_simulated_node_spec, render_simulated_spec, render_spec, DeviceRef,
    NamedDevices,
};
pub use spec::{minimum_version, ContainerEdits, Device, DeviceNode, Hook, Mount, Spec};
pub use writer::{remove_spec, write_spec, WriteError, WriteOutcome};

#[cfg(test)]
mod tests;
