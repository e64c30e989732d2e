//! Where the core reads and writes, and under which names: the host paths a prepare touches,
//! fixed when the core starts.

use crate::dra::checkpoint;
use crate::source::DeviceMode;
use std::path::{Path, PathBuf};

/// Where the core reads and writes, and under which names.
#[derive(Debug, Clone)]
pub struct DraCoreConfig {
    /// The DRA driver name (`gpu.gpuplane.dev`).
    pub driver: String,
    /// This node's name: the pool the node's ResourceSlices publish.
    pub node_name: String,
    /// Where CDI specs go (`/var/run/cdi`).
    pub cdi_root: PathBuf,
    /// Root of the NVIDIA driver's user-space files as the host sees them (`/`).
    pub driver_root: PathBuf,
    /// Where the agent finds `driver_root` when it is mounted elsewhere (see `NodePaths`).
    pub driver_root_mount: Option<PathBuf>,
    /// Where device nodes live (`/dev`).
    pub dev_root: PathBuf,
    /// Where the kernel's `/proc` is: MIG access-capability minors are read from
    /// `<proc_root>/driver/nvidia-caps/`.
    pub proc_root: PathBuf,
    /// The agent's state directory; the checkpoint is `dra-checkpoint.json` in it.
    pub state_dir: PathBuf,
    /// This boot's id (`/proc/sys/kernel/random/boot_id`); injectable for tests.
    pub boot_id_path: PathBuf,
    /// Real GPUs (specs with device nodes and driver files) or simulated ones.
    pub device_mode: DeviceMode,
}

impl DraCoreConfig {
    /// The standard host paths for `driver` on `node_name` with state in `state_dir`.
    pub fn new(driver: &str, node_name: &str, state_dir: &Path) -> Self {
        DraCoreConfig {
            driver: driver.to_string(),
            node_name: node_name.to_string(),
            cdi_root: PathBuf::from("/var/run/cdi"),
            driver_root: PathBuf::from("/"),
            driver_root_mount: None,
            dev_root: PathBuf::from("/dev"),
            proc_root: PathBuf::from("/proc"),
            state_dir: state_dir.to_path_buf(),
            boot_id_path: PathBuf::from(checkpoint::DEFAULT_BOOT_ID_PATH),
            device_mode: DeviceMode::Hardware,
        }
    }
}
