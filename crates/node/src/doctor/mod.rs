//! `gpuplane doctor`: the checks a platform team walks after a driver or agent upgrade, on the
//! node, one line each with what to fix. Each check looks at one thing the agent or the
//! container runtime needs (the driver root and device nodes, NVML, the kubelet's directories,
//! sockets and the API versions it serves on them, CDI in containerd, the MPS program, the MIG capability files, the running
//! agent's `/readyz`) and says `ok`, `warn` (works, with a limit worth knowing) or `fail`.
//!
//! The pure half, [`containerd_cdi`] and [`Report`], decides from what was read; [`examine`]
//! reads it. Nothing here writes: a doctor that created a missing directory would hide the
//! fault the agent meets.

pub mod agent_pod;
mod kubelet_api;
pub mod slices;
pub mod smoke;

use crate::cdi::driver::{discover_mounted, ProcCaps};
use crate::inventory::Inventory;
use crate::paths::HostPaths;
use crate::source::{DeviceMode, DeviceSource};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, with a limit worth knowing (a feature off, a check skipped).
    Warn,
    Fail,
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was checked: `nvml`, `driver`, `device-nodes`, `kubelet`, `kubelet-apis`, `cdi`,
    /// `containerd`, `mps`, `mig`, `agent`, `agent-pod`, `slices`, `smoke-device-plugin`,
    /// `smoke-dra`.
    pub check: &'static str,
    pub status: Status,
    /// What was found, naming the path or address.
    pub detail: String,
    /// What to do; empty when `ok`.
    pub fix: String,
}

impl Check {
    pub fn ok(check: &'static str, detail: impl Into<String>) -> Check {
        Check {
            check,
            status: Status::Ok,
            detail: detail.into(),
            fix: String::new(),
        }
    }

    pub fn warn(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            check,
            status: Status::Warn,
            detail: detail.into(),
            fix: fix.into(),
        }
    }

    pub fn fail(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            check,
            status: Status::Fail,
            detail: detail.into(),
            fix: fix.into(),
        }
    }
}

/// Every check, in the order an operator walks them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// How many checks failed (warnings pass).
    pub fn failed(&self) -> usize {
        self.checks
            .iter()
            .filter(|c| c.status == Status::Fail)
            .count()
    }

    /// One line per check: status, name, what was found, and the fix on failure or warning.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let status = match c.status {
                Status::Ok => "ok",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            out.push_str(&format!("{status:<4}  {:<12}  {}", c.check, c.detail));
            if !c.fix.is_empty() {
                out.push_str(&format!("; fix: {}", c.fix));
            }
            out.push('\n');
        }
        out.push_str(&match self.failed() {
            0 => "node ready for gpuplane\n".to_string(),
            n => format!("{n} check(s) failed\n"),
        });
        out
    }
}

/// Where to look, as the agent's flags name it.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    pub paths: HostPaths,
    pub mode: DeviceMode,
    /// containerd's config file (`/etc/containerd/config.toml`).
    pub containerd_config: PathBuf,
    /// The running agent's `--metrics-addr`; `None`: the agent check is skipped.
    pub agent_addr: Option<SocketAddr>,
}

/// Runs every check against this node. `source` is the agent's device source (NVML, or a
/// simulated machine, which needs no driver files or device nodes), or why it did not open.
pub fn examine(opts: &DoctorOptions, source: Result<&dyn DeviceSource, String>) -> Report {
    let mut checks = Vec::new();
    let inventory = match source.and_then(|s| s.discover().map_err(|e| e.to_string())) {
        Ok(found) => {
            let inv = found.inventory;
            checks.push(Check::ok(
                "nvml",
                format!(
                    "{} GPU(s), {} MIG device(s), driver {}",
                    inv.gpus.len(),
                    mig_devices(&inv),
                    inv.driver_version
                ),
            ));
            Some(inv)
        }
        Err(e) => {
            checks.push(Check::fail(
                "nvml",
                format!("cannot read the devices: {e}"),
                "check that the driver is loaded (nvidia-smi) and that --nvml-lib or the driver root holds libnvidia-ml.so.1",
            ));
            None
        }
    };
    // A simulated machine has no driver files, device nodes, MPS program or MIG minors.
    let hardware = opts.mode == DeviceMode::Hardware;
    if hardware {
        checks.extend(driver_files(&opts.paths, inventory.as_ref()));
    }
    let kubelet = kubelet(&opts.paths);
    let sockets = kubelet.status == Status::Ok;
    checks.push(kubelet);
    // Asked only once the sockets exist (else `kubelet` already says what is missing).
    if sockets {
        checks.push(kubelet_api::kubelet_apis(&opts.paths));
    }
    checks.push(cdi_root(&opts.paths.cdi_root));
    checks.push(containerd(&opts.containerd_config, &opts.paths.cdi_root));
    if hardware {
        checks.push(mps(&opts.paths));
        checks.extend(
            inventory
                .as_ref()
                .and_then(|inv| mig(&opts.paths.proc_root, inv)),
        );
    }
    checks.push(match opts.agent_addr {
        Some(addr) => agent(addr),
        None => Check::warn(
            "agent",
            "not checked",
            "pass --agent-addr with the agent's --metrics-addr to check its /readyz",
        ),
    });
    Report { checks }
}

/// The driver root's libraries and the device nodes the inventory needs.
fn driver_files(paths: &HostPaths, inv: Option<&Inventory>) -> Vec<Check> {
    let root = paths.driver_files();
    if !root.is_dir() {
        return vec![Check::fail(
            "driver",
            format!("driver root {} is not a directory", root.display()),
            "point --driver-root (and --driver-root-mount) at the driver's files: / for a host-installed driver, /run/nvidia/driver with the GPU operator",
        )];
    }
    let Some(inv) = inv else {
        return vec![Check::warn(
            "driver",
            format!("driver root {}: not checked without NVML", root.display()),
            "fix NVML first",
        )];
    };
    let files = discover_mounted(
        &paths.driver_root,
        paths.driver_root_mount.as_deref(),
        &paths.dev_root,
        inv,
        &ProcCaps::new(&paths.proc_root),
    );
    let nvml = files.libraries.iter().find(|l| {
        l.host_path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("libnvidia-ml.so"))
    });
    let driver = match nvml {
        Some(lib) => Check::ok(
            "driver",
            format!(
                "{} libraries under {}, {}",
                files.libraries.len(),
                root.display(),
                lib.host_path.display()
            ),
        ),
        None => Check::fail(
            "driver",
            format!(
                "no libnvidia-ml.so.{} under {}",
                inv.driver_version,
                root.display()
            ),
            "install the driver's user-space libraries there, or point --driver-root at them",
        ),
    };
    let nodes = match files.check_all() {
        Ok(()) => Check::ok(
            "device-nodes",
            format!("every device node the inventory needs is in {}", paths.dev_root.display()),
        ),
        Err(e) => Check::fail(
            "device-nodes",
            e.to_string(),
            "load the nvidia, nvidia-uvm (and, for MIG, nvidia-caps) modules, or run nvidia-ctk system create-device-nodes",
        ),
    };
    vec![driver, nodes]
}

/// The kubelet's registration directories and the sockets the agent dials.
fn kubelet(paths: &HostPaths) -> Check {
    let root = &paths.kubelet_root;
    let wanted = [
        (paths.device_plugins().join("kubelet.sock"), true),
        (paths.pod_resources_socket(), true),
        (root.join("plugins_registry"), false),
    ];
    let missing: Vec<String> = wanted
        .iter()
        .filter(|(path, socket)| !is_kind(path, *socket))
        .map(|(path, socket)| {
            format!(
                "{} ({})",
                path.display(),
                if *socket { "socket" } else { "directory" }
            )
        })
        .collect();
    if missing.is_empty() {
        Check::ok(
            "kubelet",
            format!(
                "{}: device plugin and PodResources sockets, plugins_registry/ for DRA",
                root.display()
            ),
        )
    } else {
        Check::fail(
            "kubelet",
            format!("missing: {}", missing.join(", ")),
            "check --kubelet-root (the kubelet's --root-dir) and that the kubelet runs",
        )
    }
}

fn is_kind(path: &Path, socket: bool) -> bool {
    std::fs::metadata(path).is_ok_and(|m| {
        if socket {
            m.file_type().is_socket()
        } else {
            m.is_dir()
        }
    })
}

/// The directory the agent writes CDI specs into.
fn cdi_root(dir: &Path) -> Check {
    if dir.is_dir() {
        let specs = std::fs::read_dir(dir)
            .map(|d| d.filter_map(Result::ok).count())
            .unwrap_or(0);
        Check::ok("cdi", format!("{} holds {specs} file(s)", dir.display()))
    } else {
        Check::fail(
            "cdi",
            format!("CDI spec directory {} is missing", dir.display()),
            "create it (the agent writes specs there), or point --cdi-root at one containerd reads",
        )
    }
}

fn containerd(config: &Path, cdi_root: &Path) -> Check {
    match std::fs::read_to_string(config) {
        Ok(text) => containerd_cdi(&text, config, cdi_root),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Check::warn(
            "containerd",
            format!("no {}: containerd's defaults apply (CDI is off before containerd 2.0)", config.display()),
            "on containerd 1.7, set enable_cdi = true under [plugins.\"io.containerd.grpc.v1.cri\"]; pass --containerd-config where the file lives elsewhere",
        ),
        Err(e) => Check::fail(
            "containerd",
            format!("cannot read {}: {e}", config.display()),
            "run the doctor where it can read containerd's config",
        ),
    }
}

/// Whether containerd's config `text` (at `path`) has CDI on and reads specs from `cdi_root`.
///
/// From containerd's docs/cri/config.md: config `version = 2` (containerd 1.x) keeps the CRI
/// options under `[plugins."io.containerd.grpc.v1.cri"]`, where `enable_cdi` defaults to
/// false; `version = 3` (containerd 2.x) keeps them under
/// `[plugins."io.containerd.cri.v1.runtime"]`, where CDI is on by default. Both read specs
/// from `cdi_spec_dirs`, by default `/etc/cdi` and `/var/run/cdi`.
pub fn containerd_cdi(text: &str, path: &Path, cdi_root: &Path) -> Check {
    let table: toml::Table = match text.parse() {
        Ok(t) => t,
        Err(e) => {
            return Check::fail(
                "containerd",
                format!("{} is not TOML: {e}", path.display()),
                "fix the file (containerd itself refuses to start with it)",
            )
        }
    };
    let version = table
        .get("version")
        .and_then(toml::Value::as_integer)
        .unwrap_or(1);
    let (section, cdi_default) = match version {
        3.. => ("io.containerd.cri.v1.runtime", true),
        _ => ("io.containerd.grpc.v1.cri", false),
    };
    let cri = table
        .get("plugins")
        .and_then(|p| p.get(section))
        .and_then(toml::Value::as_table);
    let enabled = cri
        .and_then(|c| c.get("enable_cdi"))
        .and_then(toml::Value::as_bool)
        .unwrap_or(cdi_default);
    if !enabled {
        return Check::fail(
            "containerd",
            format!(
                "{} (version {version}): CDI is off, so containers get no devices from gpuplane's specs",
                path.display()
            ),
            format!("set enable_cdi = true under [plugins.\"{section}\"] and restart containerd"),
        );
    }
    let dirs: Vec<PathBuf> = match cri.and_then(|c| c.get("cdi_spec_dirs")) {
        Some(v) => v
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(toml::Value::as_str)
                    .map(PathBuf::from)
                    .collect()
            })
            .unwrap_or_default(),
        None => vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
    };
    if dirs.iter().any(|d| same_dir(d, cdi_root)) {
        Check::ok(
            "containerd",
            format!(
                "{} (version {version}): CDI on, specs read from {}",
                path.display(),
                cdi_root.display()
            ),
        )
    } else {
        let listed: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        Check::fail(
            "containerd",
            format!(
                "{}: cdi_spec_dirs [{}] leaves out {}, where the agent writes",
                path.display(),
                listed.join(", "),
                cdi_root.display()
            ),
            format!("add {} to cdi_spec_dirs under [plugins.\"{section}\"], or point --cdi-root at a listed one", cdi_root.display()),
        )
    }
}

/// Equal paths, or `/run/...` and `/var/run/...` (`/var/run` links to `/run` on every
/// distribution the agent runs on).
fn same_dir(a: &Path, b: &Path) -> bool {
    let plain = |p: &Path| {
        p.strip_prefix("/var")
            .map_or(p.to_path_buf(), |r| Path::new("/").join(r))
    };
    a == b || (a.starts_with("/var/run") || a.starts_with("/run")) && plain(a) == plain(b)
}

/// The MPS control program that fractional GPUs need.
fn mps(paths: &HostPaths) -> Check {
    let program = paths.driver_files().join(crate::mps::PROGRAM);
    if program.is_file() {
        Check::ok("mps", program.display().to_string())
    } else {
        Check::warn(
            "mps",
            format!("{} is missing: fractional GPUs (sharing.consumableCapacity) cannot start MPS", program.display()),
            "install the driver's nvidia-cuda-mps-control, or leave consumable-capacity sharing off",
        )
    }
}

/// The MIG capability minors the agent resolves instances' access nodes from (only where a GPU
/// has MIG devices).
fn mig(proc_root: &Path, inv: &Inventory) -> Option<Check> {
    let devices = mig_devices(inv);
    if devices == 0 {
        return None;
    }
    let minors = proc_root.join("driver/nvidia-caps/mig-minors");
    Some(if minors.is_file() {
        Check::ok(
            "mig",
            format!("{devices} MIG device(s); {}", minors.display()),
        )
    } else {
        Check::fail(
            "mig",
            format!("{devices} MIG device(s) but no {}", minors.display()),
            "load the nvidia-caps driver (nvidia-modprobe -m), which MIG device access needs",
        )
    })
}

fn mig_devices(inv: &Inventory) -> usize {
    inv.gpus.iter().map(|g| g.mig_devices.len()).sum()
}

/// The running agent's `/readyz`. A plain HTTP/1.0 GET over a std socket with a deadline: one
/// request from a CLI needs no async runtime or client pool.
fn agent(addr: SocketAddr) -> Check {
    let deadline = Duration::from_secs(3);
    let answer = (|| -> std::io::Result<String> {
        let mut s = TcpStream::connect_timeout(&addr, deadline)?;
        s.set_read_timeout(Some(deadline))?;
        s.set_write_timeout(Some(deadline))?;
        s.write_all(format!("GET /readyz HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
        let mut text = String::new();
        s.take(64 * 1024).read_to_string(&mut text)?;
        Ok(text)
    })();
    match answer {
        Ok(text) => {
            let status = text.split_whitespace().nth(1).unwrap_or("");
            let body = text.split("\r\n\r\n").nth(1).unwrap_or("").trim();
            if status == "200" {
                Check::ok("agent", format!("http://{addr}/readyz: ready"))
            } else {
                Check::fail(
                    "agent",
                    format!("http://{addr}/readyz answered {status}: {body}"),
                    "read the agent's log: it names what it waits for",
                )
            }
        }
        Err(e) => Check::fail(
            "agent",
            format!("http://{addr}/readyz: {e}"),
            "start the agent (kubectl -n gpuplane-system get pods -o wide), or pass its --metrics-addr",
        ),
    }
}
