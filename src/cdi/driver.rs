//! Host discovery: which NVIDIA device nodes, libraries, binaries and hook binary a CDI spec
//! should reference on this node. The only I/O in the CDI module besides writing.
//!
//! Two roots, as NVIDIA's toolkit has them:
//! - the *driver root* (`/` for a host-installed driver, `/run/nvidia/driver` for the GPU
//!   operator's driver container): libraries and binaries are looked up under it. In the spec
//!   the host path is `<driver root>/usr/lib/...`, the container path `/usr/lib/...`;
//! - the *dev root*: the host directory holding the device nodes, normally `/dev` (note: this is
//!   the `dev` directory itself, where NVIDIA's `--dev-root` names its parent). A node is
//!   `<dev root>/nvidiactl` on the host and `/dev/nvidiactl` in the container.
//!
//! MIG access capabilities: a MIG device needs the GPU-instance and compute-instance access
//! nodes `/dev/nvidia-caps/nvidia-cap<N>`. The minor `N` of each comes from a lookup function
//! passed to [`DriverFiles::discover_with`]; [`ProcCaps`] is the real one (it reads
//! `<proc root>/driver/nvidia/capabilities/gpu<minor>/mig/gi<gi>[/ci<ci>]/access`, line
//! `DeviceFileMinor: N`, and falls back to `<proc root>/driver/nvidia-caps/mig-minors`).
//! A MIG device whose minors are unknown gets no cap nodes and a warning.
//!
//! Device nodes are checked for what they are, not only for existing: each must be a character
//! device (a regular file or symlink left by a broken install is not a GPU), `/dev/nvidia<N>`
//! must be `195:<the GPU's minor>`, `nvidiactl` `195:255`, a cap node the minor its name and
//! `/proc` give, and `nvidia-uvm`/`nvidia-caps` nodes the major `<proc root>/devices` lists for
//! them (when it lists them). A node that is absent or wrong is a [`NodeProblem`]; no spec may
//! name it ([`DeviceNodesError`] is the one refusal both kubelet APIs give).

use crate::inventory::Inventory;
use nix::sys::stat::{lstat, major, minor, SFlag};
use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use tracing::warn;

/// Directories (relative to the driver root) searched for the driver's user-space libraries,
/// in priority order: for a library found in several, the first holding the driver's version
/// wins.
pub const LIBRARY_DIRS: &[&str] = &[
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib64",
    "usr/lib",
];

/// Library base names (before `.so.<version>`) of the driver's compute and utility libraries.
pub const LIBRARIES: &[&str] = &[
    "libcuda",
    "libcudadebugger",
    "libnvidia-allocator",
    "libnvidia-cfg",
    "libnvidia-compiler",
    "libnvidia-gpucomp",
    "libnvidia-ml",
    "libnvidia-nvvm",
    "libnvidia-opencl",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-ptxjitcompiler",
];

/// Directories (relative to the driver root) searched for binaries, in priority order.
pub const BINARY_DIRS: &[&str] = &["usr/bin", "bin"];

/// The driver's utility binaries mounted into containers.
pub const BINARIES: &[&str] = &[
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-smi",
];

/// Hook binaries that can update the container's ldcache, preferred first.
pub const HOOK_BINARIES: &[&str] = &["nvidia-cdi-hook", "nvidia-ctk"];

/// Control nodes every GPU container needs, under `/dev`.
pub const CONTROL_NODES: &[&str] = &["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// Control nodes added only when present (display driver).
pub const OPTIONAL_CONTROL_NODES: &[&str] = &["nvidia-modeset"];

/// The NVIDIA kernel driver's fixed character-device major: `/dev/nvidia<minor>`, `nvidiactl`
/// (minor 255) and `nvidia-modeset` (minor 254).
pub const NVIDIA_MAJOR: u64 = 195;
/// Minor of `/dev/nvidiactl`.
pub const CTL_MINOR: u64 = 255;
/// Minor of `/dev/nvidia-modeset`.
pub const MODESET_MINOR: u64 = 254;
/// `/proc/devices` names of the drivers with a dynamic major.
pub const UVM_DRIVER: &str = "nvidia-uvm";
pub const CAPS_DRIVER: &str = "nvidia-caps";

/// The device number a node must have; `None` where this node cannot know it (the dynamic
/// major of `nvidia-uvm` when `/proc/devices` does not list the driver).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Expected {
    pub major: Option<u64>,
    pub minor: Option<u64>,
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.major, self.minor) {
            (Some(ma), Some(mi)) => write!(f, "{ma}:{mi}"),
            (Some(ma), None) => write!(f, "major {ma}"),
            (None, Some(mi)) => write!(f, "minor {mi}"),
            (None, None) => write!(f, "any character device"),
        }
    }
}

/// What is at a device node's path (as `lstat` sees it: a symlink is not followed, as the
/// container runtimes do not follow one either).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Missing,
    CharDevice {
        major: u64,
        minor: u64,
    },
    /// Anything else: "regular file", "directory", "symbolic link", "block device", ...
    Other {
        kind: &'static str,
    },
    Unreadable {
        reason: String,
    },
}

/// Why a device node may not go into a spec.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum NodeFault {
    Missing,
    NotCharDevice {
        kind: &'static str,
    },
    WrongNumber {
        found: (u64, u64),
        expected: Expected,
    },
    Unreadable {
        reason: String,
    },
}

/// A device node a spec would need that is absent or not what it must be.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeProblem {
    /// The host path.
    pub path: PathBuf,
    pub fault: NodeFault,
}

impl fmt::Display for NodeProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.path.display();
        match &self.fault {
            NodeFault::Missing => write!(f, "{p} does not exist yet"),
            NodeFault::NotCharDevice { kind } => {
                write!(f, "{p} is a {kind}, not a character device")
            }
            NodeFault::WrongNumber {
                found: (ma, mi),
                expected,
            } => write!(f, "{p} has device number {ma}:{mi}, expected {expected}"),
            NodeFault::Unreadable { reason } => write!(f, "{p} cannot be examined: {reason}"),
        }
    }
}

/// The refusal both kubelet APIs give (DRA NodePrepare, device plugin Allocate) while device
/// nodes a spec needs are absent or wrong: no spec naming them is written, and a retry
/// succeeds once the driver has created them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "device nodes are missing or invalid: {}; no CDI spec names them until the NVIDIA driver has created them as it should",
    .problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
)]
pub struct DeviceNodesError {
    pub problems: Vec<NodeProblem>,
}

/// Judges what was found against what must be there (pure).
pub fn check_node(found: &Found, expected: Expected) -> Option<NodeFault> {
    match found {
        Found::Missing => Some(NodeFault::Missing),
        Found::Other { kind } => Some(NodeFault::NotCharDevice { kind }),
        Found::Unreadable { reason } => Some(NodeFault::Unreadable {
            reason: reason.clone(),
        }),
        Found::CharDevice { major, minor } => {
            let wrong = expected.major.is_some_and(|m| m != *major)
                || expected.minor.is_some_and(|m| m != *minor);
            wrong.then_some(NodeFault::WrongNumber {
                found: (*major, *minor),
                expected,
            })
        }
    }
}

/// `lstat` of a device node's host path.
pub fn examine(path: &Path) -> Found {
    match lstat(path) {
        Ok(st) => {
            let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
            let other = |kind| Found::Other { kind };
            match kind {
                SFlag::S_IFCHR => Found::CharDevice {
                    major: major(st.st_rdev),
                    minor: minor(st.st_rdev),
                },
                SFlag::S_IFREG => other("regular file"),
                SFlag::S_IFDIR => other("directory"),
                SFlag::S_IFLNK => other("symbolic link"),
                SFlag::S_IFBLK => other("block device"),
                SFlag::S_IFIFO => other("named pipe"),
                SFlag::S_IFSOCK => other("socket"),
                _ => other("file of unknown type"),
            }
        }
        Err(nix::errno::Errno::ENOENT) | Err(nix::errno::Errno::ENOTDIR) => Found::Missing,
        Err(e) => Found::Unreadable {
            reason: e.desc().to_string(),
        },
    }
}

/// `<proc root>/devices`: the major of each character-device driver (`195 nvidia`); block
/// devices and malformed lines are skipped.
pub fn parse_char_majors(text: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut in_char = false;
    for line in text.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            in_char = line == "Character devices:";
            continue;
        }
        if !in_char {
            continue;
        }
        let mut it = line.split_whitespace();
        if let (Some(num), Some(name), None) = (it.next(), it.next(), it.next()) {
            if let Ok(num) = num.parse() {
                out.insert(name.to_string(), num);
            }
        }
    }
    out
}

/// A file as the host sees it and where it appears in the container.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct HostFile {
    pub host_path: PathBuf,
    pub container_path: PathBuf,
}

/// A MIG access capability, named as NVIDIA's `mig-minors` file names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MigCap {
    /// `gpu<minor>/gi<gi>/access`
    GpuInstance { gpu_minor: u32, gi: u32 },
    /// `gpu<minor>/gi<gi>/ci<ci>/access`
    ComputeInstance { gpu_minor: u32, gi: u32, ci: u32 },
}

impl MigCap {
    /// The key in `/proc/driver/nvidia-caps/mig-minors`.
    pub fn key(&self) -> String {
        match *self {
            MigCap::GpuInstance { gpu_minor, gi } => format!("gpu{gpu_minor}/gi{gi}/access"),
            MigCap::ComputeInstance { gpu_minor, gi, ci } => {
                format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access")
            }
        }
    }

    /// The access file, relative to the proc root.
    pub fn proc_path(&self) -> PathBuf {
        let (gpu, rest) = match *self {
            MigCap::GpuInstance { gpu_minor, gi } => (gpu_minor, format!("gi{gi}/access")),
            MigCap::ComputeInstance { gpu_minor, gi, ci } => {
                (gpu_minor, format!("gi{gi}/ci{ci}/access"))
            }
        };
        PathBuf::from(format!("driver/nvidia/capabilities/gpu{gpu}/mig/{rest}"))
    }
}

/// The `DeviceFileMinor: N` line of a capability access file.
pub fn parse_device_file_minor(text: &str) -> Option<u32> {
    text.lines().find_map(|l| {
        l.trim()
            .strip_prefix("DeviceFileMinor:")
            .and_then(|v| v.trim().parse().ok())
    })
}

/// `/proc/driver/nvidia-caps/mig-minors`: lines `<cap> <minor>`; malformed lines are skipped.
pub fn parse_mig_minors(text: &str) -> BTreeMap<String, u32> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (cap, minor, rest) = (it.next()?, it.next()?, it.next());
            if rest.is_some() {
                return None;
            }
            Some((cap.to_string(), minor.parse().ok()?))
        })
        .collect()
}

/// Device numbers as the NVIDIA kernel driver publishes them under a proc root: MIG
/// capability minors and the majors of the drivers that get a dynamic one.
#[derive(Debug, Clone, Default)]
pub struct ProcCaps {
    proc_root: PathBuf,
    mig_minors: BTreeMap<String, u32>,
    char_majors: BTreeMap<String, u64>,
}

impl ProcCaps {
    /// Reads `<proc_root>/driver/nvidia-caps/mig-minors` (absent on nodes without MIG
    /// support: then only the per-instance access files are consulted) and
    /// `<proc_root>/devices` now.
    pub fn new(proc_root: &Path) -> Self {
        let mig_minors = fs::read_to_string(proc_root.join("driver/nvidia-caps/mig-minors"))
            .map(|t| parse_mig_minors(&t))
            .unwrap_or_default();
        let char_majors = fs::read_to_string(proc_root.join("devices"))
            .map(|t| parse_char_majors(&t))
            .unwrap_or_default();
        ProcCaps {
            proc_root: proc_root.to_path_buf(),
            mig_minors,
            char_majors,
        }
    }

    /// The major `/proc/devices` lists for a character-device driver (`nvidia-uvm`).
    pub fn char_major(&self, driver: &str) -> Option<u64> {
        self.char_majors.get(driver).copied()
    }

    /// The minor of `/dev/nvidia-caps/nvidia-cap<N>` for `cap`.
    pub fn minor(&self, cap: MigCap) -> Option<u32> {
        fs::read_to_string(self.proc_root.join(cap.proc_path()))
            .ok()
            .and_then(|t| parse_device_file_minor(&t))
            .or_else(|| self.mig_minors.get(&cap.key()).copied())
    }
}

/// What the driver installation on this node offers for CDI specs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverFiles {
    pub driver_root: PathBuf,
    pub dev_root: PathBuf,
    /// `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools` (always, present or not) and
    /// `nvidia-modeset` (when present).
    pub control_nodes: Vec<HostFile>,
    /// Access-capability nodes of each MIG device whose minors are known, by
    /// (GPU minor, GPU instance, compute instance).
    pub mig_cap_nodes: BTreeMap<(u32, u32, u32), Vec<HostFile>>,
    /// One real file (`.so.<version>`, not a symlink) per library found.
    pub libraries: Vec<HostFile>,
    pub binaries: Vec<HostFile>,
    /// Host path of `nvidia-cdi-hook` or `nvidia-ctk`; `None`: no ldcache hook.
    pub ldcache_hook: Option<PathBuf>,
    /// Device nodes the inventory needs that are absent (yet) or not what they must be, by
    /// host path. A spec rendered while this is non-empty must not be cached: render again once
    /// they are right.
    pub node_problems: Vec<NodeProblem>,
}

/// The driver's user-space files under a driver root: what a directory scan finds. It depends
/// only on the root and the driver version, so it is scanned once per driver version
/// ([`InstallCache`](super::install::InstallCache)), not per claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverInstall {
    pub libraries: Vec<HostFile>,
    pub binaries: Vec<HostFile>,
    pub ldcache_hook: Option<PathBuf>,
}

impl DriverInstall {
    /// Scans `driver_root` for the libraries of `driver_version`, the binaries and the hook.
    pub fn scan(driver_root: &Path, driver_version: &str) -> DriverInstall {
        DriverInstall {
            libraries: find_libraries(driver_root, driver_version),
            binaries: BINARIES
                .iter()
                .filter_map(|b| find_in(driver_root, BINARY_DIRS, b))
                .collect(),
            ldcache_hook: HOOK_BINARIES
                .iter()
                .find_map(|b| find_in(driver_root, BINARY_DIRS, b))
                .map(|f| f.host_path),
        }
    }
}

/// The majors of the NVIDIA drivers whose major is assigned at load time (`None`: unknown,
/// then only the node's type and minor are checked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DynamicMajors {
    pub uvm: Option<u64>,
    pub caps: Option<u64>,
}

impl DriverFiles {
    /// Discovers with device numbers from the host's `/proc`.
    pub fn discover(driver_root: &Path, dev_root: &Path, inv: &Inventory) -> DriverFiles {
        Self::discover_proc(
            driver_root,
            dev_root,
            inv,
            &ProcCaps::new(Path::new("/proc")),
        )
    }

    /// Discovers with MIG capability minors and dynamic majors from `proc`.
    pub fn discover_proc(
        driver_root: &Path,
        dev_root: &Path,
        inv: &Inventory,
        proc: &ProcCaps,
    ) -> DriverFiles {
        let majors = DynamicMajors {
            uvm: proc.char_major(UVM_DRIVER),
            caps: proc.char_major(CAPS_DRIVER),
        };
        Self::discover_checked(driver_root, dev_root, inv, &|c| proc.minor(c), majors)
    }

    /// Discovers the files for `inv`, looking MIG capability minors up with `cap_minor` (the
    /// dynamic majors unknown).
    pub fn discover_with(
        driver_root: &Path,
        dev_root: &Path,
        inv: &Inventory,
        cap_minor: &dyn Fn(MigCap) -> Option<u32>,
    ) -> DriverFiles {
        Self::discover_checked(
            driver_root,
            dev_root,
            inv,
            cap_minor,
            DynamicMajors::default(),
        )
    }

    /// Discovers the files for `inv`, checking each device node against its expected number.
    pub fn discover_checked(
        driver_root: &Path,
        dev_root: &Path,
        inv: &Inventory,
        cap_minor: &dyn Fn(MigCap) -> Option<u32>,
        majors: DynamicMajors,
    ) -> DriverFiles {
        Self::discover_nodes(driver_root, dev_root, inv, cap_minor, majors)
            .with_install(&DriverInstall::scan(driver_root, &inv.driver_version))
    }

    /// The device-node half of discovery: control, GPU and MIG capability nodes, checked.
    fn discover_nodes(
        driver_root: &Path,
        dev_root: &Path,
        inv: &Inventory,
        cap_minor: &dyn Fn(MigCap) -> Option<u32>,
        majors: DynamicMajors,
    ) -> DriverFiles {
        let mut files = DriverFiles::empty(driver_root, dev_root);
        let mut expected: Vec<(HostFile, Expected)> = Vec::new();
        let nvidia = |minor: u64| Expected {
            major: Some(NVIDIA_MAJOR),
            minor: Some(minor),
        };

        for name in CONTROL_NODES {
            let node = files.dev_node(name);
            let number = match *name {
                "nvidiactl" => nvidia(CTL_MINOR),
                "nvidia-uvm" => Expected {
                    major: majors.uvm,
                    minor: Some(0),
                },
                "nvidia-uvm-tools" => Expected {
                    major: majors.uvm,
                    minor: Some(1),
                },
                _ => Expected::default(),
            };
            expected.push((node.clone(), number));
            files.control_nodes.push(node);
        }
        for name in OPTIONAL_CONTROL_NODES {
            let node = files.dev_node(name);
            let found = examine(&node.host_path);
            if found == Found::Missing {
                continue;
            }
            // Optional: a wrong one is left out of specs, not a reason to refuse devices.
            match check_node(&found, nvidia(MODESET_MINOR)) {
                None => files.control_nodes.push(node),
                Some(fault) => warn!(
                    problem = %NodeProblem { path: node.host_path.clone(), fault },
                    "optional device node left out of CDI specs"
                ),
            }
        }
        for gpu in &inv.gpus {
            expected.push((files.gpu_node(gpu.minor), nvidia(u64::from(gpu.minor))));
            for mig in &gpu.mig_devices {
                let (gi, ci) = (mig.gpu_instance_id, mig.compute_instance_id);
                let gi_cap = MigCap::GpuInstance {
                    gpu_minor: gpu.minor,
                    gi,
                };
                let ci_cap = MigCap::ComputeInstance {
                    gpu_minor: gpu.minor,
                    gi,
                    ci,
                };
                match (cap_minor(gi_cap), cap_minor(ci_cap)) {
                    (Some(g), Some(c)) => {
                        let nodes = vec![files.cap_node(g), files.cap_node(c)];
                        for (node, minor) in nodes.iter().zip([g, c]) {
                            let number = Expected {
                                major: majors.caps,
                                minor: Some(u64::from(minor)),
                            };
                            expected.push((node.clone(), number));
                        }
                        files.mig_cap_nodes.insert((gpu.minor, gi, ci), nodes);
                    }
                    _ => warn!(
                        mig = %mig.uuid, gpu_minor = gpu.minor, gi, ci,
                        "MIG access capability minors unknown; the CDI device gets no nvidia-caps nodes"
                    ),
                }
            }
        }
        expected.sort_by(|a, b| a.0.host_path.cmp(&b.0.host_path));
        expected.dedup_by(|a, b| a.0.host_path == b.0.host_path);
        files.node_problems = expected
            .into_iter()
            .filter_map(|(node, number)| {
                check_node(&examine(&node.host_path), number).map(|fault| NodeProblem {
                    path: node.host_path,
                    fault,
                })
            })
            .collect();

        files.with_install(&DriverInstall::scan(driver_root, &inv.driver_version))
    }

    /// The device nodes of `inv` checked now, with an install scanned earlier (see
    /// [`InstallCache`](super::install::InstallCache)): per call, only `lstat`s and small
    /// `/proc` reads, no directory scan. `install` must have been scanned under `driver_root`.
    pub fn discover_nodes_with(
        driver_root: &Path,
        mount: Option<&Path>,
        dev_root: &Path,
        inv: &Inventory,
        proc: &ProcCaps,
        install: &DriverInstall,
    ) -> DriverFiles {
        let majors = DynamicMajors {
            uvm: proc.char_major(UVM_DRIVER),
            caps: proc.char_major(CAPS_DRIVER),
        };
        let scan_root = mount.unwrap_or(driver_root);
        let files = Self::discover_nodes(scan_root, dev_root, inv, &|c| proc.minor(c), majors)
            .with_install(install);
        match mount {
            Some(m) => files.seen_from_host(m, driver_root),
            None => files,
        }
    }

    fn with_install(mut self, install: &DriverInstall) -> DriverFiles {
        self.libraries = install.libraries.clone();
        self.binaries = install.binaries.clone();
        self.ldcache_hook = install.ldcache_hook.clone();
        self
    }

    /// [`DriverFiles::discover_proc`] for a driver root the host sees at `driver_root` and this
    /// process at `mount` (`None`: at `driver_root` too).
    pub fn discover_mounted(
        driver_root: &Path,
        mount: Option<&Path>,
        dev_root: &Path,
        inv: &Inventory,
        proc: &ProcCaps,
    ) -> DriverFiles {
        match mount {
            Some(m) => Self::discover_proc(m, dev_root, inv, proc).seen_from_host(m, driver_root),
            None => Self::discover_proc(driver_root, dev_root, inv, proc),
        }
    }

    /// The same files named as the host sees them, when the agent found them under `mount`
    /// (the host's driver root `host_root` mounted elsewhere in the agent's container, e.g. the
    /// host's `/` at `/host`): CDI specs are read by the runtime on the host. Paths outside
    /// `mount` are left as they are.
    pub fn seen_from_host(mut self, mount: &Path, host_root: &Path) -> DriverFiles {
        let rebase = |p: &mut PathBuf| {
            if let Ok(rest) = p.strip_prefix(mount) {
                *p = host_root.join(rest);
            }
        };
        for f in self.libraries.iter_mut().chain(self.binaries.iter_mut()) {
            rebase(&mut f.host_path);
        }
        if let Some(h) = self.ldcache_hook.as_mut() {
            rebase(h);
        }
        self.driver_root = host_root.to_path_buf();
        self
    }

    /// Nothing discovered yet: a starting point for tests and callers that fill fields in.
    pub fn empty(driver_root: &Path, dev_root: &Path) -> DriverFiles {
        DriverFiles {
            driver_root: driver_root.to_path_buf(),
            dev_root: dev_root.to_path_buf(),
            ..Default::default()
        }
    }

    /// True when every device node the inventory needs is there and right: the spec may be
    /// cached.
    pub fn is_complete(&self) -> bool {
        self.node_problems.is_empty()
    }

    /// The refusal for a spec that needs the nodes `needed` says yes to (host paths), if any
    /// of them is absent or wrong.
    pub fn check_needed(&self, needed: impl Fn(&Path) -> bool) -> Result<(), DeviceNodesError> {
        let problems: Vec<NodeProblem> = self
            .node_problems
            .iter()
            .filter(|p| needed(&p.path))
            .cloned()
            .collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(DeviceNodesError { problems })
        }
    }

    /// The refusal for a spec over every device of the inventory (the node spec).
    pub fn check_all(&self) -> Result<(), DeviceNodesError> {
        self.check_needed(|_| true)
    }

    /// `/dev/<rel>` in the container, `<dev root>/<rel>` on the host.
    pub fn dev_node(&self, rel: &str) -> HostFile {
        HostFile {
            host_path: self.dev_root.join(rel),
            container_path: Path::new("/dev").join(rel),
        }
    }

    /// `/dev/nvidia<minor>`.
    pub fn gpu_node(&self, minor: u32) -> HostFile {
        self.dev_node(&format!("nvidia{minor}"))
    }

    /// `/dev/nvidia-caps/nvidia-cap<minor>`.
    pub fn cap_node(&self, minor: u32) -> HostFile {
        self.dev_node(&format!("nvidia-caps/nvidia-cap{minor}"))
    }
}

/// `<root>/<dir>/<name>` for the first dir holding it as a file (symlinks followed).
fn find_in(root: &Path, dirs: &[&str], name: &str) -> Option<HostFile> {
    dirs.iter().find_map(|d| {
        let rel = Path::new(d).join(name);
        let host = root.join(&rel);
        fs::metadata(&host)
            .ok()
            .filter(|m| m.is_file())
            .map(|_| HostFile {
                host_path: host,
                container_path: Path::new("/").join(rel),
            })
    })
}

/// Splits `libcuda.so.550.90.07` into (`libcuda`, `550.90.07`) for a known library base name.
fn library_version(file_name: &str) -> Option<(&'static str, &str)> {
    let (base, version) = file_name.split_once(".so.")?;
    let base = LIBRARIES.iter().find(|l| **l == base)?;
    let valid = !version.is_empty()
        && !version.starts_with('.')
        && !version.ends_with('.')
        && !version.contains("..")
        && version.chars().all(|c| c.is_ascii_digit() || c == '.');
    valid.then_some((base, version))
}

/// The driver's libraries under `root`: per base name the candidate whose version is the
/// driver's, else the highest version; ties go to the earlier directory of [`LIBRARY_DIRS`].
fn find_libraries(root: &Path, driver_version: &str) -> Vec<HostFile> {
    let mut seen_dirs: Vec<PathBuf> = Vec::new();
    // base name -> candidates (version, file), in directory priority order
    let mut candidates: BTreeMap<&'static str, Vec<(String, HostFile)>> = BTreeMap::new();
    for dir in LIBRARY_DIRS {
        let host_dir = root.join(dir);
        let Ok(canonical) = fs::canonicalize(&host_dir) else {
            continue;
        };
        // `lib64` is often a symlink to `usr/lib64`: scan each real directory once.
        if seen_dirs.contains(&canonical) {
            continue;
        }
        seen_dirs.push(canonical);
        let Ok(entries) = fs::read_dir(&host_dir) else {
            continue;
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        for name in names {
            if let Some((base, version)) = library_version(&name) {
                let rel = Path::new(dir).join(&name);
                candidates.entry(base).or_default().push((
                    version.to_string(),
                    HostFile {
                        host_path: root.join(&rel),
                        container_path: Path::new("/").join(rel),
                    },
                ));
            }
        }
    }
    let mut out = Vec::new();
    for (base, cands) in candidates {
        let chosen = cands.iter().find(|(v, _)| v == driver_version).or_else(|| {
            // max_by keeps the last maximum; iterate reversed so the earliest dir wins ties.
            cands
                .iter()
                .rev()
                .max_by(|a, b| super::spec::compare_versions(&a.0, &b.0))
        });
        if let Some((version, file)) = chosen {
            if version != driver_version {
                warn!(
                    library = base, found = %version, driver = driver_version,
                    "no library of the driver's version; using the highest found"
                );
            }
            out.push(file.clone());
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_library_versions() {
        assert_eq!(
            library_version("libnvidia-ml.so.550.90.07"),
            Some(("libnvidia-ml", "550.90.07"))
        );
        assert_eq!(library_version("libcuda.so.1"), Some(("libcuda", "1")));
        assert_eq!(
            library_version("libnvidia-pkcs11-openssl3.so.550.90.07"),
            Some(("libnvidia-pkcs11-openssl3", "550.90.07"))
        );
        for no in [
            "libcuda.so",
            "libcuda.so.",
            "libcuda.so.1.",
            "libcuda.so.1..2",
            "libcuda.so.abc",
            "libcudart.so.12.4",
            "libnvidia-ml.so.550.90.07.bak",
        ] {
            assert_eq!(library_version(no), None, "{no}");
        }
    }

    #[test]
    fn device_nodes_are_judged_by_type_and_number() {
        let gpu3 = Expected {
            major: Some(NVIDIA_MAJOR),
            minor: Some(3),
        };
        let char_dev = |major, minor| Found::CharDevice { major, minor };
        assert_eq!(check_node(&char_dev(195, 3), gpu3), None);
        assert_eq!(
            check_node(&char_dev(195, 7), gpu3),
            Some(NodeFault::WrongNumber {
                found: (195, 7),
                expected: gpu3
            })
        );
        assert!(check_node(&char_dev(1, 3), gpu3).is_some());
        // An unknown major (nvidia-uvm without /proc/devices) checks the minor only.
        let uvm = Expected {
            major: None,
            minor: Some(0),
        };
        assert_eq!(check_node(&char_dev(511, 0), uvm), None);
        assert!(check_node(&char_dev(511, 1), uvm).is_some());
        assert_eq!(
            check_node(
                &Found::Other {
                    kind: "regular file"
                },
                gpu3
            ),
            Some(NodeFault::NotCharDevice {
                kind: "regular file"
            })
        );
        assert_eq!(check_node(&Found::Missing, uvm), Some(NodeFault::Missing));
        let p = |fault| NodeProblem {
            path: "/dev/nvidia3".into(),
            fault,
        };
        assert_eq!(
            p(NodeFault::WrongNumber {
                found: (195, 7),
                expected: gpu3
            })
            .to_string(),
            "/dev/nvidia3 has device number 195:7, expected 195:3"
        );
        assert_eq!(
            p(NodeFault::NotCharDevice {
                kind: "regular file"
            })
            .to_string(),
            "/dev/nvidia3 is a regular file, not a character device"
        );
        assert_eq!(
            p(NodeFault::WrongNumber {
                found: (511, 1),
                expected: uvm
            })
            .to_string(),
            "/dev/nvidia3 has device number 511:1, expected minor 0"
        );
    }

    #[test]
    fn parses_character_majors_from_proc_devices() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n\
                    508 nvidia-uvm\n509 nvidia-caps\nbad line here\n\n\
                    Block devices:\n  8 sd\n259 blkext\n";
        let majors = parse_char_majors(text);
        assert_eq!(majors.get("nvidia-uvm"), Some(&508));
        assert_eq!(majors.get("nvidia-caps"), Some(&509));
        assert_eq!(majors.get("nvidia"), Some(&195));
        assert_eq!(
            majors.get("sd"),
            None,
            "block devices are not character devices"
        );
        let proc = tempfile::tempdir().unwrap();
        fs::write(proc.path().join("devices"), text).unwrap();
        assert_eq!(ProcCaps::new(proc.path()).char_major(UVM_DRIVER), Some(508));
        assert_eq!(
            ProcCaps::new(Path::new("/nonexistent")).char_major(UVM_DRIVER),
            None
        );
    }

    #[test]
    fn parses_cap_files() {
        let access = "DeviceFileMinor: 21\nDeviceFileMode: 292\nDeviceFileModify: 1\n";
        assert_eq!(parse_device_file_minor(access), Some(21));
        assert_eq!(parse_device_file_minor("DeviceFileMode: 292\n"), None);
        let minors = parse_mig_minors(
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\nbad\nx y z\n",
        );
        assert_eq!(minors.get("gpu0/gi1/ci0/access"), Some(&13));
        assert_eq!(minors.get("config"), Some(&1));
        assert_eq!(minors.len(), 4);
        let cap = MigCap::ComputeInstance {
            gpu_minor: 0,
            gi: 1,
            ci: 0,
        };
        assert_eq!(cap.key(), "gpu0/gi1/ci0/access");
        assert_eq!(
            cap.proc_path(),
            Path::new("driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access")
        );
    }

    #[test]
    fn proc_caps_reads_access_files_then_mig_minors() {
        let proc = tempfile::tempdir().unwrap();
        let gi = MigCap::GpuInstance {
            gpu_minor: 2,
            gi: 3,
        };
        let ci = MigCap::ComputeInstance {
            gpu_minor: 2,
            gi: 3,
            ci: 0,
        };
        let gi_file = proc.path().join(gi.proc_path());
        fs::create_dir_all(gi_file.parent().unwrap()).unwrap();
        fs::write(&gi_file, "DeviceFileMinor: 30\n").unwrap();
        fs::create_dir_all(proc.path().join("driver/nvidia-caps")).unwrap();
        fs::write(
            proc.path().join("driver/nvidia-caps/mig-minors"),
            "gpu2/gi3/access 99\ngpu2/gi3/ci0/access 31\n",
        )
        .unwrap();
        let caps = ProcCaps::new(proc.path());
        assert_eq!(caps.minor(gi), Some(30));
        assert_eq!(caps.minor(ci), Some(31));
        assert_eq!(
            caps.minor(MigCap::GpuInstance {
                gpu_minor: 0,
                gi: 0
            }),
            None
        );
    }
}
