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
//! passed to [`discover_with`]; [`ProcCaps`] is the real one (it reads
//! `<proc root>/driver/nvidia/capabilities/gpu<minor>/mig/gi<gi>[/ci<ci>]/access`, line
//! `DeviceFileMinor: N`, and falls back to `<proc root>/driver/nvidia-caps/mig-minors`, which
//! the driver fills at load for every instance that could ever exist). With the `nvidia-caps`
//! major from `<proc root>/devices` the nodes go into specs by number and the runtime makes
//! them in the container ([`CapNode::ByNumber`]): an instance made at NodePrepare has no node in
//! the host's `/dev`. Only where the major is unknown is the host's node bound, and checked.
//! A MIG device whose minors are unknown gets no cap nodes and a warning.
//!
//! Device nodes are checked for what they are, not only for existing: each must be a character
//! device (a regular file or symlink left by a broken install is not a GPU), `/dev/nvidia<N>`
//! must be `195:<the GPU's minor>`, `nvidiactl` `195:255`, a bound cap node the minor its name
//! and `/proc` give, and `nvidia-uvm` nodes the major `<proc root>/devices` lists for them (when
//! it lists them). A node that is absent or wrong is a [`NodeProblem`]; no spec may
//! name it ([`DeviceNodesError`] is the one refusal both kubelet APIs give).

use gpuplane_model::cdi::files::*;
use gpuplane_model::inventory::{Gpu, Inventory};
use nix::sys::stat::{lstat, major, minor, SFlag};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use tracing::warn;

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

/// Scans `driver_root` for the libraries of `driver_version`, the binaries and the hook.
pub fn scan_install(driver_root: &Path, driver_version: &str) -> DriverInstall {
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
    discover_checked(driver_root, dev_root, inv, &|c| proc.minor(c), majors)
}

/// Discovers the files for `inv`, looking MIG capability minors up with `cap_minor` (the
/// dynamic majors unknown).
pub fn discover_with(
    driver_root: &Path,
    dev_root: &Path,
    inv: &Inventory,
    cap_minor: &dyn Fn(MigCap) -> Option<u32>,
) -> DriverFiles {
    discover_checked(
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
    discover_nodes(driver_root, dev_root, inv, cap_minor, majors)
        .with_install(&scan_install(driver_root, &inv.driver_version))
}

/// The device-node half of discovery: control, GPU and MIG capability nodes, checked.
pub fn discover_nodes(
    driver_root: &Path,
    dev_root: &Path,
    inv: &Inventory,
    cap_minor: &dyn Fn(MigCap) -> Option<u32>,
    majors: DynamicMajors,
) -> DriverFiles {
    let mut files = DriverFiles::empty(driver_root, dev_root);
    let mut expected = control_nodes(&mut files, majors);
    add_optional_control_nodes(&mut files);
    for gpu in &inv.gpus {
        expected.extend(gpu_nodes(&mut files, gpu, cap_minor, majors));
    }
    files.node_problems = node_problems(expected);
    files
}

/// The number of an NVIDIA node of static major (`nvidia<N>`, `nvidiactl`, `nvidia-modeset`).
fn nvidia(minor: u64) -> Expected {
    Expected {
        major: Some(NVIDIA_MAJOR),
        minor: Some(minor),
    }
}

/// The control nodes every spec names, recorded in `files`, each with the number it must have.
fn control_nodes(files: &mut DriverFiles, majors: DynamicMajors) -> Vec<(HostFile, Expected)> {
    let mut expected = Vec::new();
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
    expected
}

/// Records the optional control nodes that are there and right.
fn add_optional_control_nodes(files: &mut DriverFiles) {
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
}

/// The GPU's node and, per MIG device whose capability minors are known, its two access
/// nodes (recorded in `files`), each with the number it must have.
fn gpu_nodes(
    files: &mut DriverFiles,
    gpu: &Gpu,
    cap_minor: &dyn Fn(MigCap) -> Option<u32>,
    majors: DynamicMajors,
) -> Vec<(HostFile, Expected)> {
    let mut expected = vec![(files.gpu_node(gpu.minor), nvidia(u64::from(gpu.minor)))];
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
                let nodes = [g, c].map(|minor| match majors.caps {
                    Some(major) => CapNode::ByNumber { major, minor },
                    None => {
                        let node = files.cap_node(minor);
                        let number = Expected {
                            major: None,
                            minor: Some(u64::from(minor)),
                        };
                        expected.push((node.clone(), number));
                        CapNode::Host(node)
                    }
                });
                files
                    .mig_cap_nodes
                    .insert((gpu.minor, gi, ci), nodes.to_vec());
            }
            _ => warn!(
                mig = %mig.uuid, gpu_minor = gpu.minor, gi, ci,
                "MIG access capability minors unknown; the CDI device gets no nvidia-caps nodes"
            ),
        }
    }
    expected
}

/// Each node (once, however many devices name it) that is absent or not what it must be.
fn node_problems(mut expected: Vec<(HostFile, Expected)>) -> Vec<NodeProblem> {
    expected.sort_by(|a, b| a.0.host_path.cmp(&b.0.host_path));
    expected.dedup_by(|a, b| a.0.host_path == b.0.host_path);
    expected
        .into_iter()
        .filter_map(|(node, number)| {
            check_node(&examine(&node.host_path), number).map(|fault| NodeProblem {
                path: node.host_path,
                fault,
            })
        })
        .collect()
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
    let files =
        discover_nodes(scan_root, dev_root, inv, &|c| proc.minor(c), majors).with_install(install);
    match mount {
        Some(m) => files.seen_from_host(m, driver_root),
        None => files,
    }
}

/// [`discover_proc`] for a driver root the host sees at `driver_root` and this
/// process at `mount` (`None`: at `driver_root` too).
pub fn discover_mounted(
    driver_root: &Path,
    mount: Option<&Path>,
    dev_root: &Path,
    inv: &Inventory,
    proc: &ProcCaps,
) -> DriverFiles {
    match mount {
        Some(m) => discover_proc(m, dev_root, inv, proc).seen_from_host(m, driver_root),
        None => discover_proc(driver_root, dev_root, inv, proc),
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

    #[test]
    fn proc_caps_reads_character_majors_from_proc_devices() {
        let proc = tempfile::tempdir().unwrap();
        fs::write(
            proc.path().join("devices"),
            "Character devices:\n195 nvidia\n508 nvidia-uvm\n\nBlock devices:\n259 blkext\n",
        )
        .unwrap();
        assert_eq!(ProcCaps::new(proc.path()).char_major(UVM_DRIVER), Some(508));
        assert_eq!(
            ProcCaps::new(Path::new("/nonexistent")).char_major(UVM_DRIVER),
            None
        );
    }
}
