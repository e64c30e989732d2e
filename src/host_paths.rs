//! The host paths every face that works on a node's files takes (`node`, `doctor`), so both
//! name them alike.

use gpuplane_node::paths::HostPaths;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct HostPathArgs {
    /// The kubelet's root directory.
    #[arg(long, default_value_os_t = HostPaths::standard().kubelet_root)]
    kubelet_root: PathBuf,
    /// Where CDI specs are written.
    #[arg(long, default_value_os_t = HostPaths::standard().cdi_root)]
    cdi_root: PathBuf,
    /// Root of the NVIDIA driver's files as the host sees them (e.g. /run/nvidia/driver with
    /// the GPU operator); CDI specs name files under it.
    #[arg(long, default_value_os_t = HostPaths::standard().driver_root)]
    driver_root: PathBuf,
    /// Where this process finds --driver-root when it is mounted elsewhere (a host-installed
    /// driver in a container: the host's / mounted at /host). Default: at --driver-root.
    #[arg(long, value_name = "DIR")]
    driver_root_mount: Option<PathBuf>,
    /// Where device nodes live.
    #[arg(long, default_value_os_t = HostPaths::standard().dev_root)]
    dev_root: PathBuf,
}

impl HostPathArgs {
    /// The paths, with the state directory and /proc as the face has them.
    pub fn paths(self, state_dir: PathBuf, proc_root: PathBuf) -> HostPaths {
        HostPaths {
            kubelet_root: self.kubelet_root,
            cdi_root: self.cdi_root,
            state_dir,
            driver_root: self.driver_root,
            driver_root_mount: self.driver_root_mount,
            dev_root: self.dev_root,
            proc_root,
        }
    }
}
