//! NVIDIA device nodes as the kernel driver creates them, for tests and benches that run the
//! agent as on real hardware (the fake libnvidia-ml, or an in-process source in
//! `DeviceMode::Hardware`): character devices with the driver's numbers (`nvidia<N>` 195:N,
//! `nvidiactl` 195:255, `nvidia-uvm` 0 and `nvidia-uvm-tools` 1 under the uvm major,
//! `nvidia-caps/nvidia-cap<M>` minor M), made with mknod, which needs root (CAP_MKNOD).
//!
//! The agent checks nodes for what they are, so an empty file no longer stands in for one.

use gpuplane_node::cdi::files::{CAPS_DRIVER, CTL_MINOR, NVIDIA_MAJOR, UVM_DRIVER};
use gpuplane_node::cdi::ProcCaps;
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use std::io;
use std::path::Path;

/// Major used for `nvidia-uvm` (and `nvidia-caps`) when this host's `/proc/devices` does not
/// list the driver (no NVIDIA driver loaded): the agent then checks only type and minor.
pub const STAND_IN_MAJOR: u64 = 510;

/// The majors the agent will expect on this host for the drivers with a dynamic one.
pub fn dynamic_majors() -> (u64, u64) {
    let proc = ProcCaps::new(&gpuplane_node::paths::HostPaths::standard().proc_root);
    (
        proc.char_major(UVM_DRIVER).unwrap_or(STAND_IN_MAJOR),
        proc.char_major(CAPS_DRIVER).unwrap_or(STAND_IN_MAJOR),
    )
}

/// `path` as a character device `major:minor` (mode 0666), replacing whatever is there.
pub fn make_node(path: &Path, major: u64, minor: u64) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    mknod(
        path,
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(major, minor),
    )
    .map_err(io::Error::from)
}

/// `<dev>/nvidia<minor>` for each GPU minor, and the control nodes.
pub fn make_gpu_nodes(dev: &Path, minors: impl IntoIterator<Item = u32>) -> io::Result<()> {
    let (uvm, _) = dynamic_majors();
    for minor in minors {
        make_node(
            &dev.join(format!("nvidia{minor}")),
            NVIDIA_MAJOR,
            u64::from(minor),
        )?;
    }
    make_node(&dev.join("nvidiactl"), NVIDIA_MAJOR, CTL_MINOR)?;
    make_node(&dev.join("nvidia-uvm"), uvm, 0)?;
    make_node(&dev.join("nvidia-uvm-tools"), uvm, 1)
}

/// `<dev>/nvidia-caps/nvidia-cap<minor>`.
pub fn make_cap_node(dev: &Path, minor: u32) -> io::Result<()> {
    let (_, caps) = dynamic_majors();
    make_node(
        &dev.join(format!("nvidia-caps/nvidia-cap{minor}")),
        caps,
        u64::from(minor),
    )
}

/// Whether this process may make device nodes (root, or CAP_MKNOD): tried once, in a
/// temporary directory. Tests that need nodes skip without.
pub fn can_make_nodes() -> bool {
    static CAN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CAN.get_or_init(|| {
        tempfile::tempdir().is_ok_and(|d| make_node(&d.path().join("probe"), 1, 3).is_ok())
    })
}
