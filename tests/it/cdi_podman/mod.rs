//! Real CDI consumers: podman (4.3, with runc) runs busybox containers with devices from specs
//! gpuplane wrote, once from a node spec rendered directly and once from the per-claim spec the
//! DRA driver of the running agent writes at NodePrepareResources.
//!
//! Needs root, `mknod`, podman, runc and busybox-static (`hack/test.sh` installs them). Without
//! them the tests fail when `CI` is set and otherwise print why they skipped.
//!
//! podman 4.3 has no `--cdi-spec-dir`, so specs go to `/var/run/cdi` under unique file names and
//! are removed afterwards, however a test ends. Their kinds are unique per run too
//! (`test-<id>.gpuplane.dev/gpu`, and `k8s.t<id>.gpuplane.dev/claim` from the driver name
//! `t<id>.gpuplane.dev`): two spec files in one directory defining the same device make that
//! device unresolvable, and these tests may run concurrently with themselves or next to a real
//! `nvidia.com/gpu` spec.
//!
//! The agent also keeps a node-wide spec (`gpuplane-node.json`, kind `nvidia.com/gpu`) in its
//! CDI root once every GPU's device node exists. In `/var/run/cdi` that spec would clash with a
//! real one, so the DRA test leaves the last GPU's node out: the agent then never writes it,
//! while a claim still only needs the nodes of its own devices.
//!
//! Device nodes are character devices with the NVIDIA driver's numbers (`nvidia<N>` 195:N,
//! ...), made with mknod: the agent checks them, and runc creates the same in the container.
//!
//! Simulated nodes (`gpuplane node --simulate`) write their node spec at once, needing no
//! device nodes, so their agents keep their CDI root in a temp dir, and the test puts into
//! `/var/run/cdi` what podman must read: the claim's spec as written (its kind is unique
//! already), or the node spec under a unique kind (`test-<id>.gpuplane.dev/gpu`), Allocate's
//! `nvidia.com/gpu=<name>` becoming `<that kind>=<name>`; the devices and their edits are the
//! agent's, byte for byte apart from the kind.

use crate::lab::{Lab, NODE, WAIT};
use gpuplane_model::source::{DeviceMode, DeviceSource, SimSource};
use gpuplane_node::cdi::{self, Kind, WriteOutcome};
use gpuplane_node::dra::{ClaimRef, PreparedDevice};
use gpuplane_node::node::dra::DraSettings;
use gpuplane_node::node::{NodeError, NodeOptions};
use gpuplane_node::paths::HostPaths;
use gpuplane_testkit::doubles::devnodes;
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod dra_claims;
mod rendered_spec;
mod simulated_node;

pub(crate) const CDI_ROOT: &str = "/var/run/cdi";
const NVML_LIB: &str = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.90.07";
const NVML_MARKER: &str = "gpuplane-fake-libnvidia-ml";
const SMI_MARKER: &str = "gpuplane-fake-nvidia-smi";

/// Fails under CI, skips (returning true) elsewhere.
fn skip(why: &str) -> bool {
    if std::env::var_os("CI").is_some() {
        panic!("cdi_podman: {why} (CI is set, so this is a failure; hack/test.sh installs what is needed)");
    }
    eprintln!("SKIPPED cdi_podman: {why}");
    true
}

/// True (after [`skip`]) when something these tests need is missing.
pub(crate) fn lacks_prerequisites() -> bool {
    (!is_root() && skip("needs root (mknod, podman as root)"))
        || (!have("podman", "--version") && skip("podman is not installed"))
        || (!have("runc", "--version") && skip("runc is not installed"))
        || (!Path::new("/bin/busybox").is_file()
            && skip("/bin/busybox (busybox-static) is missing"))
}

/// Unique per process and run: `<pid>-<nanoseconds>`.
pub(crate) fn unique_id() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() % 1_000_000_000)
            .unwrap_or(0)
    )
}

pub(crate) fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

pub(crate) fn ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn have(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// podman with a time limit, so a wedged runtime fails the test instead of hanging it.
pub(crate) fn podman(args: &[&str]) -> Command {
    let mut c = Command::new("timeout");
    c.arg("180").arg("podman").args(args);
    c
}

/// Removes the spec files (by stem, under [`CDI_ROOT`]) and the image however a test ends.
#[derive(Default)]
pub(crate) struct Cleanup {
    pub(crate) stems: Vec<String>,
    pub(crate) image: Option<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for stem in &self.stems {
            if let Err(e) = cdi::remove_spec(Path::new(CDI_ROOT), stem, cdi::Durability::Durable) {
                eprintln!("cleanup: {e}");
            }
        }
        if let Some(image) = &self.image {
            let _ = podman(&["rmi", "-f", image]).output();
        }
    }
}

pub(crate) fn spec_file(stem: &str) -> PathBuf {
    Path::new(CDI_ROOT).join(format!("{stem}.json"))
}

/// `<dev_root>/nvidia<minor>` for each minor and the control nodes, with the driver's numbers.
fn make_dev_nodes(dev_root: &Path, minors: impl IntoIterator<Item = u32>) {
    devnodes::make_gpu_nodes(dev_root, minors).unwrap();
}

/// A driver root with one library and one binary, in the places a real driver has them.
fn fake_driver_root(root: &Path) {
    let lib = root.join(NVML_LIB.trim_start_matches('/'));
    fs::create_dir_all(lib.parent().unwrap()).unwrap();
    fs::write(&lib, format!("{NVML_MARKER}\n")).unwrap();
    let bin = root.join("usr/bin");
    fs::create_dir_all(&bin).unwrap();
    let smi = bin.join("nvidia-smi");
    fs::write(&smi, format!("#!/bin/sh\necho {SMI_MARKER}\n")).unwrap();
    fs::set_permissions(&smi, fs::Permissions::from_mode(0o755)).unwrap();
}

/// `tar` + `podman import` of a directory holding static busybox and a few applet links, as
/// `localhost/gpuplane-busybox:test-<id>`; the image is recorded in `cleanup` before it exists.
fn busybox_image(dir: &Path, id: &str, cleanup: &mut Cleanup) -> String {
    let image = format!("localhost/gpuplane-busybox:test-{id}");
    cleanup.image = Some(image.clone());
    let rootfs = dir.join("rootfs");
    let bin = rootfs.join("bin");
    fs::create_dir_all(&bin).unwrap();
    fs::copy("/bin/busybox", bin.join("busybox")).unwrap();
    for applet in ["sh", "ls", "cat", "echo", "test", "env", "grep"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
    }
    let tar = dir.join("rootfs.tar");
    ok(Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .arg("-cf")
        .arg(&tar)
        .arg("."));
    ok(&mut podman(&["import", tar.to_str().unwrap(), &image]));
    image
}

fn run_args<'a>(device: &'a str, image: &'a str, script: &'a str) -> Vec<&'a str> {
    run_args_env(&[device], &[], image, script)
}

/// `podman run` arguments with several CDI devices and `-e NAME=value` entries.
fn run_args_env<'a>(
    devices: &[&'a str],
    env: &'a [String],
    image: &'a str,
    script: &'a str,
) -> Vec<&'a str> {
    let mut args = vec![
        "run",
        "--rm",
        "--runtime",
        "runc",
        "--network=none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
    ];
    for d in devices {
        args.extend(["--device", d]);
    }
    for e in env {
        args.extend(["-e", e.as_str()]);
    }
    args.extend([image, "sh", "-c", script]);
    args
}

/// Runs `script` in a container of `image` with CDI device `device`; its stdout.
fn run_with_device(device: &str, image: &str, script: &str) -> String {
    let out = ok(&mut podman(&run_args(device, image, script)));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `node`'s line of `ls -l` output shows a character device `major, minor`.
fn assert_char_device(ls_output: &str, node: &str, major: u64, minor: u64) {
    let line = ls_output
        .lines()
        .find(|l| l.ends_with(node))
        .unwrap_or_else(|| panic!("no {node} in:\n{ls_output}"));
    assert!(line.starts_with('c'), "{node} is not a char device: {line}");
    let numbers: String = line.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        numbers.contains(&format!(" {major}, {minor} ")),
        "{node} is not {major}:{minor}: {line}"
    );
}

/// podman refuses to start a container with `device`: CDI cannot resolve it.
fn assert_unresolvable(device: &str, image: &str) {
    let out = run(&mut podman(&run_args(device, image, "echo SHOULD-NOT-RUN")));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{device} was accepted");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("SHOULD-NOT-RUN"));
    assert!(stderr.contains("CDI") || stderr.contains("cdi"), "{stderr}");
}

/// Where the agent of a [`Agent::start`] finds the host, and its config file's text.
struct Host<'a> {
    cdi_root: &'a Path,
    dev_root: &'a Path,
    driver_root: &'a Path,
    /// The kernel's `/proc` (`None`: the real one).
    proc_root: Option<&'a Path>,
    config: &'a str,
}

/// The agent of a [`Lab`], run with our own paths and driver name ([`Lab::start`] fixes both).
struct Agent {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), NodeError>>,
}

impl Agent {
    /// A DRA-only agent (no device plugin) on `host`.
    fn start(lab: &Lab, driver: &str, host: Host<'_>, device_mode: DeviceMode) -> Agent {
        let d = lab.dir.path();
        let config_file = d.join("agent-config.yaml");
        fs::write(&config_file, host.config).unwrap();
        let standard = HostPaths::standard();
        let opts = NodeOptions {
            node_name: NODE.into(),
            paths: HostPaths {
                kubelet_root: d.join("kubelet"),
                cdi_root: host.cdi_root.to_path_buf(),
                state_dir: d.join("state"),
                driver_root: host.driver_root.to_path_buf(),
                driver_root_mount: None,
                dev_root: host.dev_root.to_path_buf(),
                proc_root: host.proc_root.map_or(standard.proc_root, Path::to_path_buf),
            },
            config_file: Some(config_file),
            sharing_switch: None,
            device_plugin: false,
            dra: Some(DraSettings {
                driver_name: driver.into(),
                client: lab.api.client().unwrap(),
                mps_pods: None,
            }),
            api: None,
            metrics_addr: None,
            device_mode,
            telemetry: None,
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let source: Arc<dyn DeviceSource> = Arc::new(lab.sim.clone());
        let task = tokio::spawn(gpuplane_node::node::run(opts, source, async {
            let _ = stopped.await;
        }));
        Agent { stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

/// NodePrepareResources of `claim` through the kubelet double: its devices, or a panic naming
/// the claim's error.
async fn prepare_claim(lab: &Lab, driver: &str, claim: &ClaimRef) -> Vec<PreparedDevice> {
    let mut answers = lab
        .dra
        .prepare(driver, std::slice::from_ref(claim))
        .await
        .unwrap();
    answers
        .remove(claim.uid.as_str())
        .unwrap()
        .unwrap_or_else(|e| panic!("prepare of {}: {e}", claim.name))
}

/// NodeUnprepareResources of `claim`, which must succeed.
async fn unprepare_claim(lab: &Lab, driver: &str, claim: &ClaimRef) {
    let mut answers = lab
        .dra
        .unprepare(driver, std::slice::from_ref(claim))
        .await
        .unwrap();
    answers.remove(claim.uid.as_str()).unwrap().unwrap();
}
