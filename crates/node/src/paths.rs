//! The host paths the node agent reads and writes, named once, with their standard values
//! ([`HostPaths::standard`], which the CLI's defaults are). The agent, the DRA core and the
//! node CDI spec all take this one value, so no path has a second default somewhere else.

use std::path::{Path, PathBuf};

/// Where things are on the host, as this process sees them (except where noted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPaths {
    /// The kubelet's root (`/var/lib/kubelet`): device-plugins/, plugins_registry/, pod-resources/.
    pub kubelet_root: PathBuf,
    /// Where CDI specs are written (`/var/run/cdi`).
    pub cdi_root: PathBuf,
    /// The agent's own durable state (`/var/lib/gpuplane`); one agent at a time.
    pub state_dir: PathBuf,
    /// Root of the NVIDIA driver's user-space files as the host sees them (`/` or
    /// `/run/nvidia/driver`): CDI specs name files under it.
    pub driver_root: PathBuf,
    /// Where the agent itself finds `driver_root` when it is mounted elsewhere in its
    /// container (a host-installed driver: the host's `/` at `/host`); `None`: at `driver_root`.
    pub driver_root_mount: Option<PathBuf>,
    /// Where device nodes live (`/dev`).
    pub dev_root: PathBuf,
    /// The kernel's `/proc`: dynamic device majors, MIG access-capability minors, the boot id.
    pub proc_root: PathBuf,
}

impl HostPaths {
    /// The standard locations on a node.
    pub fn standard() -> HostPaths {
        HostPaths {
            kubelet_root: PathBuf::from("/var/lib/kubelet"),
            cdi_root: PathBuf::from("/var/run/cdi"),
            state_dir: PathBuf::from("/var/lib/gpuplane"),
            driver_root: PathBuf::from("/"),
            driver_root_mount: None,
            dev_root: PathBuf::from("/dev"),
            proc_root: PathBuf::from("/proc"),
        }
    }

    /// Every location under one directory, as its standard name there (`<root>/kubelet`,
    /// `cdi`, `state`, `driver`, `dev`, `proc`): a node laid out in a directory (the demo, the
    /// test labs).
    pub fn under(root: &Path) -> HostPaths {
        HostPaths {
            kubelet_root: root.join("kubelet"),
            cdi_root: root.join("cdi"),
            state_dir: root.join("state"),
            driver_root: root.join("driver"),
            driver_root_mount: None,
            dev_root: root.join("dev"),
            proc_root: root.join("proc"),
        }
    }

    pub fn device_plugins(&self) -> PathBuf {
        self.kubelet_root.join("device-plugins")
    }

    pub fn pod_resources_socket(&self) -> PathBuf {
        self.kubelet_root.join("pod-resources").join("kubelet.sock")
    }

    /// This boot's id, which the DRA checkpoint records.
    pub fn boot_id(&self) -> PathBuf {
        self.proc_root.join("sys/kernel/random/boot_id")
    }

    /// Where this process reads the driver's files: `driver_root_mount`, else `driver_root`.
    pub fn driver_files(&self) -> &Path {
        self.driver_root_mount
            .as_deref()
            .unwrap_or(&self.driver_root)
    }
}
