//! What the driver installation on a node offers a CDI spec, as plain data: device nodes and
//! what each must be, libraries, binaries and the ldcache hook ([`DriverFiles`]), and the
//! pure parsers of the `/proc` files their numbers come from. Finding them on a host (the
//! I/O) is the product's `cdi::driver`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

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

/// A MIG access-capability node `/dev/nvidia-caps/nvidia-cap<minor>` a container needs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum CapNode {
    /// Made inside the container by the runtime from its number (CDI `type: c`, `major`,
    /// `minor`): the host need not have the node. NVIDIA's driver creates no node in `/dev`
    /// for an instance made at run time (nvidia-modprobe makes them on request only), and its
    /// DRA driver hands them over this way (`internal/common/nvcaps.go`).
    ByNumber { major: u64, minor: u32 },
    /// The host's node, bound: only where `/proc/devices` does not list `nvidia-caps`, so its
    /// major is unknown; the node must then exist on the host.
    Host(HostFile),
}

impl CapNode {
    /// The node's path inside the container.
    pub fn container_path(minor: u32) -> PathBuf {
        PathBuf::from(format!("/dev/nvidia-caps/nvidia-cap{minor}"))
    }
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
    pub mig_cap_nodes: BTreeMap<(u32, u32, u32), Vec<CapNode>>,
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
/// (the product's `cdi::install::InstallCache`), not per claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverInstall {
    pub libraries: Vec<HostFile>,
    pub binaries: Vec<HostFile>,
    pub ldcache_hook: Option<PathBuf>,
}

/// The majors of the NVIDIA drivers whose major is assigned at load time (`None`: unknown,
/// then only the node's type and minor are checked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DynamicMajors {
    pub uvm: Option<u64>,
    pub caps: Option<u64>,
}

impl DriverFiles {
    pub fn with_install(mut self, install: &DriverInstall) -> DriverFiles {
        self.libraries = install.libraries.clone();
        self.binaries = install.binaries.clone();
        self.ldcache_hook = install.ldcache_hook.clone();
        self
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

    /// True when every device node the inventory needs is there and right. For the tests'
    /// assertions; the product asks per spec ([`Self::check_needed`]).
    #[doc(hidden)]
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

/// Splits `libcuda.so.550.90.07` into (`libcuda`, `550.90.07`) for a known library base name.
pub fn library_version(file_name: &str) -> Option<(&'static str, &str)> {
    let (base, version) = file_name.split_once(".so.")?;
    let base = LIBRARIES.iter().find(|l| **l == base)?;
    let valid = !version.is_empty()
        && !version.starts_with('.')
        && !version.ends_with('.')
        && !version.contains("..")
        && version.chars().all(|c| c.is_ascii_digit() || c == '.');
    valid.then_some((base, version))
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
}
