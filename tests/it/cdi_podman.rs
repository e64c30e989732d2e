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

/// The `env` of a container of `image` started with CDI `devices` and `env`, as lines.
fn container_env(devices: &[&str], env: &[String], image: &str) -> Vec<String> {
    let out = ok(&mut podman(&run_args_env(devices, env, image, "env")));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
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

#[test]
fn podman_injects_a_rendered_spec() {
    if lacks_prerequisites() {
        return;
    }
    let id = unique_id();
    let tmp = tempfile::tempdir().unwrap();
    let driver_root = tmp.path().join("driver");
    let dev_root = tmp.path().join("dev");
    fake_driver_root(&driver_root);
    fs::create_dir_all(&dev_root).unwrap();

    let inv = gpuplane_model::sim::load("pcie-l4x4").unwrap();

    // Before the nodes exist the agent must not write the spec.
    let proc = cdi::ProcCaps::new(&HostPaths::standard().proc_root);
    let files = cdi::driver::discover_proc(&driver_root, &dev_root, &inv, &proc);
    assert!(!files.is_complete());
    make_dev_nodes(&dev_root, inv.gpus.iter().map(|g| g.minor));
    let files = cdi::driver::discover_proc(&driver_root, &dev_root, &inv, &proc);
    assert!(files.is_complete(), "{:?}", files.node_problems);

    let kind: Kind = format!("test-{id}.gpuplane.dev/gpu").parse().unwrap();
    let spec = cdi::render_node_spec(&inv, &files, &kind);
    assert_eq!(spec.cdi_version, "0.5.0", "podman 4.3 reads at most 0.5.0");

    let stem = format!("gpuplane-test-{id}");
    let mut cleanup = Cleanup {
        stems: vec![stem.clone()],
        image: None,
    };
    assert_eq!(
        cdi::write_spec(Path::new(CDI_ROOT), &stem, &spec, cdi::Durability::Durable).unwrap(),
        WriteOutcome::Written
    );
    assert_eq!(
        cdi::write_spec(Path::new(CDI_ROOT), &stem, &spec, cdi::Durability::Durable).unwrap(),
        WriteOutcome::Unchanged
    );
    let spec_file = spec_file(&stem);
    assert!(spec_file.is_file());

    let image = busybox_image(tmp.path(), &id, &mut cleanup);

    let device = format!("{kind}=0");
    let script = format!(
        "ls -l /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm; cat {NVML_LIB}; \
         nvidia-smi; /usr/bin/nvidia-smi; echo VIS=$NVIDIA_VISIBLE_DEVICES; \
         test -e /dev/nvidia1 && echo LEAKED-nvidia1; true"
    );
    let stdout = run_with_device(&device, &image, &script);
    let (uvm, _) = devnodes::dynamic_majors();
    for (node, major, minor) in [
        ("/dev/nvidia0", 195, u64::from(inv.gpus[0].minor)),
        ("/dev/nvidiactl", 195, 255),
        ("/dev/nvidia-uvm", uvm, 0),
    ] {
        assert_char_device(&stdout, node, major, minor);
    }
    assert!(stdout.contains(NVML_MARKER), "{stdout}");
    assert!(stdout.contains(SMI_MARKER), "{stdout}");
    assert!(stdout.contains("VIS=void"), "{stdout}");
    assert!(
        !stdout.contains("LEAKED"),
        "device 1 was not requested:\n{stdout}"
    );

    // By UUID too, as NVIDIA's specs allow.
    let by_uuid = format!("{kind}={}", inv.gpus[2].uuid);
    assert!(run_with_device(&by_uuid, &image, "ls /dev/nvidia2").contains("/dev/nvidia2"));

    // A device the spec does not define is refused.
    assert_unresolvable(&format!("{kind}=9"), &image);

    drop(cleanup);
    assert!(!spec_file.exists());
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

/// A claim `name` allocated (by the absent scheduler) to `device` of this node, with the
/// opaque `config` for `driver` in its allocation.
fn allocated_claim(lab: &Lab, driver: &str, name: &str, device: &str, config: Value) -> ClaimRef {
    let namespace = "team-a";
    let obj = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": driver, "count": 1}}]}},
        "status": {"allocation": {"devices": {
            "results": [{"request": "gpus", "driver": driver, "pool": NODE, "device": device}],
            "config": config
        }}}
    });
    let stored = lab.api.put_json(obj).unwrap();
    ClaimRef::parse(namespace, stored["metadata"]["uid"].as_str().unwrap(), name).unwrap()
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

/// [`allocated_claim`] with a time-slicing `GpuConfig`.
fn time_sliced_claim(lab: &Lab, driver: &str, device: &str) -> ClaimRef {
    let config = json!([{"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing"}}}}]);
    allocated_claim(lab, driver, "shared", device, config)
}

/// A `/proc` as NVIDIA's kernel driver fills it, for GPUs of `minors`: `devices` lists
/// `nvidia-caps` at `caps_major`, and `driver/nvidia-caps/mig-minors` has a minor for every GPU
/// and compute instance that could ever exist (the driver writes it at load: 15 GPU instances
/// of 8 compute instances each per GPU), so an instance made later already has its minors.
fn fake_proc(root: &Path, minors: impl IntoIterator<Item = u32>, caps_major: u64) {
    fs::create_dir_all(root.join("sys/kernel/random")).unwrap();
    fs::write(root.join("sys/kernel/random/boot_id"), "boot-1\n").unwrap();
    fs::write(
        root.join("devices"),
        format!("Character devices:\n195 nvidia\n{caps_major} nvidia-caps\n"),
    )
    .unwrap();
    let mut text = String::from("config 1\nmonitor 2\n");
    let mut next = 3;
    for gpu in minors {
        for gi in 0..15 {
            text.push_str(&format!("gpu{gpu}/gi{gi}/access {next}\n"));
            next += 1;
            for ci in 0..8 {
                text.push_str(&format!("gpu{gpu}/gi{gi}/ci{ci}/access {next}\n"));
                next += 1;
            }
        }
    }
    fs::create_dir_all(root.join("driver/nvidia-caps")).unwrap();
    fs::write(root.join("driver/nvidia-caps/mig-minors"), text).unwrap();
}

/// Dynamic MIG on hardware: the instance NodePrepareResources makes has no
/// `/dev/nvidia-caps` node on the host (nothing creates one), yet the container sees both its
/// access nodes, GPU instance and compute instance, with the numbers `/proc` gives: the spec
/// names them by number and runc makes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_gives_a_dynamic_mig_container_the_access_nodes_the_host_lacks() {
    if lacks_prerequisites() {
        return;
    }
    const CAPS_MAJOR: u64 = 237;
    let id = unique_id();
    let driver = format!("t{id}.gpuplane.dev");
    let lab = Lab::new("dynamic-mig-mixed").await;
    let inv = lab.sim.discover().unwrap().inventory;
    let d = lab.dir.path();
    let (driver_root, dev_root, proc_root) = (d.join("driver"), d.join("devnodes"), d.join("proc"));
    fake_driver_root(&driver_root);
    // Every GPU node but the last (no node-wide spec in /var/run/cdi, module docs).
    let minors: Vec<u32> = inv.gpus.iter().map(|g| g.minor).collect();
    make_dev_nodes(&dev_root, minors[..minors.len() - 1].iter().copied());
    fake_proc(&proc_root, minors.iter().copied(), CAPS_MAJOR);
    let mut cleanup = Cleanup::default();
    let image = busybox_image(d, &id, &mut cleanup);
    let host = Host {
        cdi_root: Path::new(CDI_ROOT),
        dev_root: &dev_root,
        driver_root: &driver_root,
        proc_root: Some(&proc_root),
        config: "dynamicMig:\n  gpus: [0]\n",
    };
    let agent = Agent::start(&lab, &driver, host, DeviceMode::Hardware);
    lab.dra.wait_registered(&driver, WAIT).await.unwrap();
    let device = "gpu-0-mig-3g40gb-at4";
    let claim = allocated_claim(&lab, &driver, "dynamic", device, json!([]));
    let stem = format!("gpuplane-claim-{}", claim.uid);
    cleanup.stems.push(stem.clone());
    let devices = prepare_claim(&lab, &driver, &claim).await;
    let cdi_id = format!("k8s.{driver}/claim={}-{device}", claim.uid);
    assert_eq!(devices[0].cdi_ids, std::slice::from_ref(&cdi_id));

    // The instance the prepare made, and the minors /proc gives for it.
    let mig = lab.sim.discover().unwrap().inventory.gpus[0].mig_devices[0].clone();
    let proc = cdi::ProcCaps::new(&proc_root);
    let minor = |cap| proc.minor(cap).unwrap();
    let gpu_minor = inv.gpus[0].minor;
    let (gi, ci) = (mig.gpu_instance_id, mig.compute_instance_id);
    let gi_minor = minor(cdi::files::MigCap::GpuInstance { gpu_minor, gi });
    let ci_minor = minor(cdi::files::MigCap::ComputeInstance { gpu_minor, gi, ci });
    assert!(
        !dev_root.join("nvidia-caps").exists(),
        "the host has no access nodes"
    );

    let script = format!(
        "ls -l /dev/nvidia-caps/ /dev/nvidia{gpu_minor}; ls /dev/nvidia-caps | grep -c cap"
    );
    let stdout = run_with_device(&cdi_id, &image, &script);
    assert_char_device(
        &stdout,
        &format!("nvidia-cap{gi_minor}"),
        CAPS_MAJOR,
        u64::from(gi_minor),
    );
    assert_char_device(
        &stdout,
        &format!("nvidia-cap{ci_minor}"),
        CAPS_MAJOR,
        u64::from(ci_minor),
    );
    assert_char_device(
        &stdout,
        &format!("/dev/nvidia{gpu_minor}"),
        195,
        u64::from(gpu_minor),
    );
    assert_eq!(
        stdout.lines().last(),
        Some("2"),
        "only its own two access nodes:\n{stdout}"
    );

    unprepare_claim(&lab, &driver, &claim).await;
    assert!(lab.sim.discover().unwrap().inventory.gpus[0]
        .mig_devices
        .is_empty());
    agent.stop().await;
    drop(cleanup);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_a_container_with_the_spec_of_a_prepared_dra_claim() {
    if lacks_prerequisites() {
        return;
    }
    let started = Instant::now();
    let id = unique_id();
    let driver = format!("t{id}.gpuplane.dev");
    let lab = Lab::new("dgx-h100").await;
    let inv = lab.sim.discover().unwrap().inventory;
    assert_eq!(
        inv.driver_version, "550.90.07",
        "the library below is named for it"
    );
    let driver_root = lab.dir.path().join("driver");
    let dev_root = lab.dir.path().join("devnodes");
    fake_driver_root(&driver_root);
    // Every node but the last GPU's (see the module docs): no node-wide spec.
    let minors: Vec<u32> = inv.gpus[..inv.gpus.len() - 1]
        .iter()
        .map(|g| g.minor)
        .collect();
    assert_eq!(minors, (0..7).collect::<Vec<_>>());
    make_dev_nodes(&dev_root, minors);

    let node_stem = gpuplane_node::node::cdi::NODE_SPEC_STEM;
    let node_spec_was_there = spec_file(node_stem).exists();
    let mut cleanup = Cleanup::default();
    if !node_spec_was_there {
        cleanup.stems.push(node_stem.into());
    }
    let image = busybox_image(lab.dir.path(), &id, &mut cleanup);

    let host = Host {
        cdi_root: Path::new(CDI_ROOT),
        dev_root: &dev_root,
        driver_root: &driver_root,
        proc_root: None,
        config: "",
    };
    let agent = Agent::start(&lab, &driver, host, DeviceMode::Hardware);
    lab.dra.wait_registered(&driver, WAIT).await.unwrap();
    let claim = time_sliced_claim(&lab, &driver, "gpu-2");
    let stem = format!("gpuplane-claim-{}", claim.uid);
    cleanup.stems.push(stem.clone());

    let devices = prepare_claim(&lab, &driver, &claim).await;
    let kind = format!("k8s.{driver}/claim");
    let cdi_id = format!("{kind}={}-gpu-2", claim.uid);
    let ids: Vec<&str> = devices
        .iter()
        .flat_map(|d| d.cdi_ids.iter().map(String::as_str))
        .collect();
    assert_eq!(ids, [cdi_id.as_str()]);
    let spec: Value = serde_json::from_slice(&fs::read(spec_file(&stem)).unwrap()).unwrap();
    assert_eq!(spec["kind"], kind.as_str(), "{spec:#}");
    if !node_spec_was_there {
        assert!(
            !spec_file(node_stem).exists(),
            "the agent wrote a node-wide nvidia.com/gpu spec into {CDI_ROOT}"
        );
    }

    let script = format!(
        "ls -l /dev/nvidia2 /dev/nvidiactl; env | grep GPUPLANE; cat {NVML_LIB}; \
         test -e /dev/nvidia3 && echo LEAKED-nvidia3; true"
    );
    let stdout = run_with_device(&cdi_id, &image, &script);
    for (node, minor) in [("/dev/nvidia2", 2), ("/dev/nvidiactl", 255)] {
        assert_char_device(&stdout, node, 195, minor);
    }
    let env: Vec<&str> = stdout.lines().filter(|l| l.contains('=')).collect();
    assert!(
        env.contains(&"GPUPLANE_SHARING_STRATEGY=TimeSlicing"),
        "{stdout}"
    );
    assert!(stdout.lines().any(|l| l == NVML_MARKER), "{stdout}");
    assert!(
        !stdout.contains("LEAKED"),
        "gpu-3 was not allocated:\n{stdout}"
    );

    unprepare_claim(&lab, &driver, &claim).await;
    assert!(
        !spec_file(&stem).exists(),
        "unprepare left the claim's spec"
    );
    assert_unresolvable(&cdi_id, &image);

    agent.stop().await;
    drop(cleanup);
    eprintln!("cdi_podman DRA claim test took {:?}", started.elapsed());
}

/// `key=value` lines of `env` output, as a set of lines.
fn has_line(env: &[String], line: &str) -> bool {
    env.iter().any(|l| l == line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_a_container_with_what_allocate_gives_on_a_simulated_node() {
    if lacks_prerequisites() {
        return;
    }
    let id = unique_id();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // A simulated machine of two GPUs; no device nodes, no driver files anywhere.
    let mut inv = gpuplane_model::sim::load("pcie-l4x4").unwrap();
    inv.gpus.truncate(2);
    inv.topology.links.retain(|l| l.from < 2 && l.to < 2);
    let kubelet = KubeletDouble::start(&d.join("kubelet")).await.unwrap();
    let opts = NodeOptions {
        node_name: NODE.into(),
        paths: HostPaths {
            kubelet_root: d.join("kubelet"),
            cdi_root: d.join("cdi"),
            state_dir: d.join("state"),
            driver_root: d.join("driver"),
            driver_root_mount: None,
            dev_root: d.join("dev"),
            ..HostPaths::standard()
        },
        config_file: None,
        sharing_switch: None,
        device_plugin: true,
        dra: None,
        api: None,
        metrics_addr: None,
        device_mode: DeviceMode::Simulated,
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let source: Arc<dyn DeviceSource> = Arc::new(SimSource::new(inv.clone()));
    let task = tokio::spawn(gpuplane_node::node::run(opts, source, async {
        let _ = stopped.await;
    }));
    let agent = Agent { stop, task };
    let view = kubelet
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 2)
        })
        .await
        .unwrap()["nvidia.com/gpu"]
        .clone();
    let ids: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    let grant = kubelet.allocate("nvidia.com/gpu", &ids).await.unwrap();
    let uuids = [inv.gpus[0].uuid.as_str(), inv.gpus[1].uuid.as_str()];

    // The node spec the agent wrote, into /var/run/cdi under a kind of this run's.
    let written = d
        .join("cdi")
        .join(format!("{}.json", gpuplane_node::node::cdi::NODE_SPEC_STEM));
    let mut spec: cdi::Spec = serde_json::from_slice(&fs::read(&written).unwrap()).unwrap();
    assert_eq!(spec.kind, "nvidia.com/gpu");
    assert_eq!(spec.cdi_version, "0.5.0", "podman 4.3 reads at most 0.5.0");
    let kind = format!("test-{id}.gpuplane.dev/gpu");
    spec.kind = kind.clone();
    let stem = format!("gpuplane-test-{id}");
    let mut cleanup = Cleanup {
        stems: vec![stem.clone()],
        image: None,
    };
    cdi::write_spec(Path::new(CDI_ROOT), &stem, &spec, cdi::Durability::Durable).unwrap();
    let image = busybox_image(d, &id, &mut cleanup);

    let devices: Vec<String> = grant
        .cdi_devices
        .iter()
        .map(|c| {
            let name = c
                .name
                .strip_prefix("nvidia.com/gpu=")
                .unwrap_or_else(|| panic!("{} is not a node spec name", c.name));
            format!("{kind}={name}")
        })
        .collect();
    assert_eq!(devices.len(), 2, "{:?}", grant.cdi_devices);
    let env: Vec<String> = grant.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let device_refs: Vec<&str> = devices.iter().map(String::as_str).collect();
    let seen = container_env(&device_refs, &env, &image);
    let visible = format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(","));
    assert!(has_line(&seen, &visible), "{seen:#?}");
    for (i, uuid) in uuids.iter().enumerate() {
        let line = format!("GPUPLANE_DEVICE_{i}=index={i},uuid={uuid},profile=");
        assert!(has_line(&seen, &line), "{line} not in {seen:#?}");
    }
    assert!(!has_line(&seen, "NVIDIA_VISIBLE_DEVICES=void"), "{seen:#?}");

    agent.stop().await;
    drop(cleanup);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_a_container_with_a_claim_prepared_on_a_simulated_node() {
    if lacks_prerequisites() {
        return;
    }
    let id = unique_id();
    let driver = format!("t{id}.gpuplane.dev");
    let lab = Lab::new("a100-mig-mixed").await;
    let inv = lab.sim.discover().unwrap().inventory;
    let dra_devices = inv.dra_devices();
    let whole = *dra_devices
        .iter()
        .find(|d| matches!(d, gpuplane_model::inventory::DeviceRef::Gpu(_)))
        .expect("a whole GPU");
    let part = *dra_devices
        .iter()
        .find(|d| matches!(d, gpuplane_model::inventory::DeviceRef::Mig { .. }))
        .expect("a MIG device");
    let (parent, mig) = match part {
        gpuplane_model::inventory::DeviceRef::Mig { parent, mig } => (parent, mig),
        gpuplane_model::inventory::DeviceRef::Gpu(_) => unreachable!("found as MIG"),
    };
    let mig_index = parent
        .mig_devices
        .iter()
        .position(|m| m.uuid == mig.uuid)
        .unwrap();

    let cdi_root = lab.dir.path().join("cdi-sim");
    let nowhere = lab.dir.path().join("no-such-dir");
    let host = Host {
        cdi_root: &cdi_root,
        dev_root: &nowhere,
        driver_root: &nowhere,
        proc_root: None,
        config: "",
    };
    let agent = Agent::start(&lab, &driver, host, DeviceMode::Simulated);
    lab.dra.wait_registered(&driver, WAIT).await.unwrap();
    let obj = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "sim", "namespace": "team-a"},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": driver, "count": 1}},
            {"name": "part", "exactly": {"deviceClassName": driver, "count": 1}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": driver, "pool": NODE, "device": whole.dra_name()},
            {"request": "part", "driver": driver, "pool": NODE, "device": part.dra_name()}]}}}
    });
    let stored = lab.api.put_json(obj).unwrap();
    let claim =
        ClaimRef::parse("team-a", stored["metadata"]["uid"].as_str().unwrap(), "sim").unwrap();
    let devices = prepare_claim(&lab, &driver, &claim).await;
    let ids: Vec<String> = devices
        .iter()
        .flat_map(|d| d.cdi_ids.iter().cloned())
        .collect();
    let kind = format!("k8s.{driver}/claim");
    assert_eq!(
        ids,
        [
            format!("{kind}={}-{}", claim.uid, whole.dra_name()),
            format!("{kind}={}-{}", claim.uid, part.dra_name())
        ]
    );

    // The claim's spec as the agent wrote it, where podman reads specs.
    let stem = format!("gpuplane-claim-{}", claim.uid);
    let mut cleanup = Cleanup {
        stems: vec![stem.clone()],
        image: None,
    };
    let written = cdi_root.join(format!("{stem}.json"));
    fs::create_dir_all(CDI_ROOT).unwrap();
    fs::copy(&written, spec_file(&stem)).unwrap();
    let image = busybox_image(lab.dir.path(), &id, &mut cleanup);

    let whole_line = format!(
        "GPUPLANE_DEVICE_{i}=index={i},uuid={},profile=",
        whole.uuid(),
        i = whole.gpu().index
    );
    let part_line = format!(
        "GPUPLANE_DEVICE_{p}_MIG_{mig_index}=index={p}:{mig_index},uuid={},profile={}",
        mig.uuid,
        mig.profile,
        p = parent.index
    );
    let visible = format!("NVIDIA_VISIBLE_DEVICES={},{}", whole.uuid(), mig.uuid);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let seen = container_env(&refs, &[], &image);
    for line in [&whole_line, &part_line, &visible] {
        assert!(has_line(&seen, line), "{line} not in {seen:#?}");
    }
    // Only the MIG request: its own identity; NVIDIA_VISIBLE_DEVICES is the claim's (the
    // documented limit of a spec-level value).
    let seen = container_env(&refs[1..], &[], &image);
    assert!(has_line(&seen, &part_line), "{seen:#?}");
    assert!(!has_line(&seen, &whole_line), "{seen:#?}");
    assert!(has_line(&seen, &visible), "{seen:#?}");

    unprepare_claim(&lab, &driver, &claim).await;
    assert!(!written.exists(), "unprepare left the claim's spec");
    agent.stop().await;
    drop(cleanup);
}
