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

#[path = "support/lab.rs"]
mod lab;

use gpuplane::cdi::{self, DriverFiles, Kind, WriteOutcome};
use gpuplane::dra::ClaimRef;
use gpuplane::node::dra::DraSettings;
use gpuplane::node::{NodeError, NodeOptions, NodePaths};
use gpuplane::source::DeviceSource;
use lab::{Lab, NODE, WAIT};
use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const CDI_ROOT: &str = "/var/run/cdi";
const NVML_LIB: &str = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.90.07";
const NVML_MARKER: &str = "gpuplane-fake-libnvidia-ml";
const SMI_MARKER: &str = "gpuplane-fake-nvidia-smi";
const CONTROL_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// Fails under CI, skips (returning true) elsewhere.
fn skip(why: &str) -> bool {
    if std::env::var_os("CI").is_some() {
        panic!("cdi_podman: {why} (CI is set, so this is a failure; hack/test.sh installs what is needed)");
    }
    eprintln!("SKIPPED cdi_podman: {why}");
    true
}

/// True (after [`skip`]) when something these tests need is missing.
fn lacks_prerequisites() -> bool {
    (!is_root() && skip("needs root (mknod, podman as root)"))
        || (!have("podman", "--version") && skip("podman is not installed"))
        || (!have("runc", "--version") && skip("runc is not installed"))
        || (!Path::new("/bin/busybox").is_file()
            && skip("/bin/busybox (busybox-static) is missing"))
}

/// Unique per process and run: `<pid>-<nanoseconds>`.
fn unique_id() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() % 1_000_000_000)
            .unwrap_or(0)
    )
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

fn ok(cmd: &mut Command) -> Output {
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
fn podman(args: &[&str]) -> Command {
    let mut c = Command::new("timeout");
    c.arg("180").arg("podman").args(args);
    c
}

/// Removes the spec files (by stem, under [`CDI_ROOT`]) and the image however a test ends.
#[derive(Default)]
struct Cleanup {
    stems: Vec<String>,
    image: Option<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for stem in &self.stems {
            if let Err(e) = cdi::remove_spec(Path::new(CDI_ROOT), stem) {
                eprintln!("cleanup: {e}");
            }
        }
        if let Some(image) = &self.image {
            let _ = podman(&["rmi", "-f", image]).output();
        }
    }
}

fn spec_file(stem: &str) -> PathBuf {
    Path::new(CDI_ROOT).join(format!("{stem}.json"))
}

fn mknod_char(path: &Path) {
    // 1:3 is /dev/null: harmless inside and outside the container.
    ok(Command::new("mknod").arg(path).args(["c", "1", "3"]));
}

/// `<dev_root>/<name>` as a character device for each name.
fn make_dev_nodes<S: AsRef<str>>(dev_root: &Path, names: &[S]) {
    fs::create_dir_all(dev_root).unwrap();
    for n in names {
        mknod_char(&dev_root.join(n.as_ref()));
    }
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
    vec![
        "run",
        "--rm",
        "--runtime",
        "runc",
        "--network=none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        "--device",
        device,
        image,
        "sh",
        "-c",
        script,
    ]
}

/// Runs `script` in a container of `image` with CDI device `device`; its stdout.
fn run_with_device(device: &str, image: &str, script: &str) -> String {
    let out = ok(&mut podman(&run_args(device, image, script)));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `node`'s line of `ls -l` output shows a character device 1, 3.
fn assert_char_device(ls_output: &str, node: &str) {
    let line = ls_output
        .lines()
        .find(|l| l.ends_with(node))
        .unwrap_or_else(|| panic!("no {node} in:\n{ls_output}"));
    assert!(line.starts_with('c'), "{node} is not a char device: {line}");
    assert!(line.contains("1,   3") || line.contains("1, 3"), "{line}");
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

    let inv = gpuplane::sim::load("pcie-l4x4").unwrap();
    let mut nodes: Vec<String> = inv
        .gpus
        .iter()
        .map(|g| format!("nvidia{}", g.minor))
        .collect();
    nodes.extend(CONTROL_NODES.map(String::from));

    // Before the nodes exist the agent must not write the spec.
    let files = DriverFiles::discover(&driver_root, &dev_root, &inv);
    assert!(!files.is_complete());
    make_dev_nodes(&dev_root, &nodes);
    let files = DriverFiles::discover(&driver_root, &dev_root, &inv);
    assert!(
        files.is_complete(),
        "missing: {:?}",
        files.missing_device_nodes
    );

    let kind: Kind = format!("test-{id}.gpuplane.dev/gpu").parse().unwrap();
    let spec = cdi::render_node_spec(&inv, &files, &kind);
    assert_eq!(spec.cdi_version, "0.5.0", "podman 4.3 reads at most 0.5.0");

    let stem = format!("gpuplane-test-{id}");
    let mut cleanup = Cleanup {
        stems: vec![stem.clone()],
        image: None,
    };
    assert_eq!(
        cdi::write_spec(Path::new(CDI_ROOT), &stem, &spec).unwrap(),
        WriteOutcome::Written
    );
    assert_eq!(
        cdi::write_spec(Path::new(CDI_ROOT), &stem, &spec).unwrap(),
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
    for node in ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"] {
        assert_char_device(&stdout, node);
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

/// The agent of a [`Lab`], run with our own paths and driver name ([`Lab::start`] fixes both).
struct Agent {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), NodeError>>,
}

impl Agent {
    /// A DRA-only agent (no device plugin) with its CDI root in `/var/run/cdi`.
    fn start(lab: &Lab, driver: &str, dev_root: &Path, driver_root: &Path) -> Agent {
        let d = lab.dir.path();
        let opts = NodeOptions {
            node_name: NODE.into(),
            paths: NodePaths {
                kubelet_root: d.join("kubelet"),
                cdi_root: CDI_ROOT.into(),
                state_dir: d.join("state"),
                driver_root: driver_root.to_path_buf(),
                driver_root_mount: None,
                dev_root: dev_root.to_path_buf(),
            },
            config_file: None,
            device_plugin: false,
            dra: Some(DraSettings {
                driver_name: driver.into(),
                client: lab.api.client().unwrap(),
            }),
            metrics_addr: None,
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let source: Arc<dyn DeviceSource> = Arc::new(lab.sim.clone());
        let task = tokio::spawn(gpuplane::node::run(opts, source, async {
            let _ = stopped.await;
        }));
        Agent { stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

/// A claim allocated (by the absent scheduler) to `device` of this node, with an MPS config for
/// `driver` in its allocation.
fn mps_claim(lab: &Lab, driver: &str, device: &str, threads: u8) -> ClaimRef {
    let (namespace, name) = ("team-a", "mps");
    let obj = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": driver, "count": 1}}]}},
        "status": {"allocation": {"devices": {
            "results": [{"request": "gpus", "driver": driver, "pool": NODE, "device": device}],
            "config": [{"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": driver, "parameters": {
                "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": threads}}}}}]
        }}}
    });
    let stored = lab.api.put_json(obj).unwrap();
    ClaimRef {
        namespace: namespace.into(),
        name: name.into(),
        uid: stored["metadata"]["uid"].as_str().unwrap().into(),
    }
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
    let mut nodes: Vec<String> = inv.gpus[..inv.gpus.len() - 1]
        .iter()
        .map(|g| format!("nvidia{}", g.minor))
        .collect();
    assert_eq!(
        nodes,
        (0..7).map(|i| format!("nvidia{i}")).collect::<Vec<_>>()
    );
    nodes.extend(CONTROL_NODES.map(String::from));
    make_dev_nodes(&dev_root, &nodes);

    let node_stem = gpuplane::node::cdi::NODE_SPEC_STEM;
    let node_spec_was_there = spec_file(node_stem).exists();
    let mut cleanup = Cleanup::default();
    if !node_spec_was_there {
        cleanup.stems.push(node_stem.into());
    }
    let image = busybox_image(lab.dir.path(), &id, &mut cleanup);

    let agent = Agent::start(&lab, &driver, &dev_root, &driver_root);
    lab.dra.wait_registered(&driver, WAIT).await.unwrap();
    let claim = mps_claim(&lab, &driver, "gpu-2", 50);
    let stem = format!("gpuplane-claim-{}", claim.uid);
    cleanup.stems.push(stem.clone());

    let mut answers = lab
        .dra
        .prepare(&driver, std::slice::from_ref(&claim))
        .await
        .unwrap();
    let devices = answers.remove(&claim.uid).unwrap().unwrap();
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
        "ls -l /dev/nvidia2 /dev/nvidiactl; env | grep -E 'CUDA_MPS|GPUPLANE'; cat {NVML_LIB}; \
         test -e /dev/nvidia3 && echo LEAKED-nvidia3; true"
    );
    let stdout = run_with_device(&cdi_id, &image, &script);
    for node in ["/dev/nvidia2", "/dev/nvidiactl"] {
        assert_char_device(&stdout, node);
    }
    let env: Vec<&str> = stdout.lines().filter(|l| l.contains('=')).collect();
    assert!(
        env.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"),
        "{stdout}"
    );
    assert!(env.contains(&"GPUPLANE_SHARING_STRATEGY=MPS"), "{stdout}");
    assert!(stdout.lines().any(|l| l == NVML_MARKER), "{stdout}");
    assert!(
        !stdout.contains("LEAKED"),
        "gpu-3 was not allocated:\n{stdout}"
    );

    let mut answers = lab
        .dra
        .unprepare(&driver, std::slice::from_ref(&claim))
        .await
        .unwrap();
    answers.remove(&claim.uid).unwrap().unwrap();
    assert!(
        !spec_file(&stem).exists(),
        "unprepare left the claim's spec"
    );
    assert_unresolvable(&cdi_id, &image);

    agent.stop().await;
    drop(cleanup);
    eprintln!("cdi_podman DRA claim test took {:?}", started.elapsed());
}
