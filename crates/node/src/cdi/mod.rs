//! CDI (Container Device Interface) specs: how containers get the GPUs the kubelet or DRA
//! allocated.
//!
//! The pure half (`gpuplane_model::cdi`, re-exported here): the file format and cdiVersion
//! rules (`spec`), validated names (`name`), what a driver install offers (`files`) and the
//! rendering of specs (`render`). Here, the I/O:
//!
//! - [`driver`]: discovery of device nodes, driver libraries, binaries and the ldcache hook on
//!   the host (the only I/O besides writing);
//! - [`hook`]: the agent's own CDI hook (a share's GPU memory limit) and its executable;
//! - [`install`]: the driver-install scan, cached per driver root and driver version;
//! - [`writer`]: atomic, skip-if-identical writes of `<cdi root>/<stem>.json`.

pub mod driver;
pub mod hook;
pub mod install;
pub mod node_spec;
pub mod writer;

pub use gpuplane_model::cdi::*;

pub use driver::ProcCaps;
pub use install::InstallCache;
pub use writer::{remove_spec, write_spec, Durability, WriteError, WriteOutcome};
