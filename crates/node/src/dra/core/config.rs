//! What the core is and where it reads and writes: its driver and pool names, the host paths
//! a prepare touches (one [`HostPaths`]), and whether the devices are real.

use crate::mps::MpsHost;
use crate::paths::HostPaths;
use crate::source::DeviceMode;
use std::sync::Arc;

/// What the core is and where it reads and writes, fixed when it starts.
#[derive(Debug, Clone)]
pub struct DraCoreConfig {
    /// The DRA driver name (`gpu.gpuplane.dev`).
    pub driver: String,
    /// This node's name: the pool the node's ResourceSlices publish.
    pub node_name: String,
    /// CDI specs go to `cdi_root`, the checkpoint is `<state_dir>/dra-checkpoint.json`, the
    /// boot id and MIG capability minors come from `proc_root`.
    pub paths: HostPaths,
    /// Real GPUs (specs with device nodes and driver files) or simulated ones.
    pub device_mode: DeviceMode,
    /// Where MPS control daemons run; `None`: as the agent's own processes
    /// ([`crate::mps::process::MpsDaemons`] at `paths`).
    pub mps: Option<Arc<dyn MpsHost>>,
    /// What a share's memory-limit hook runs, where the driver limits GPU memory per cgroup
    /// (`None`: share memory limits are cooperative only).
    pub memory_limits: Option<crate::cdi::MemoryLimitHook>,
}

impl DraCoreConfig {
    /// `driver` on `node_name` at the standard host paths.
    pub fn new(driver: &str, node_name: &str) -> Self {
        DraCoreConfig {
            driver: driver.to_string(),
            node_name: node_name.to_string(),
            paths: HostPaths::standard(),
            device_mode: DeviceMode::Hardware,
            mps: None,
            memory_limits: None,
        }
    }
}
