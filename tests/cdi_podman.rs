//! A real CDI consumer: podman (4.3, with runc) runs a busybox container with a device from a
//! spec gpuplane rendered and wrote.
//!
//! Needs root, `mknod`, podman, runc and busybox-static (`hack/test.sh` installs them). Without
//! them the test fails when `CI` is set and otherwise prints why it skipped.
//!
//! podman 4.3 has no `--cdi-spec-dir`, so the spec goes to `/var/run/cdi` under a unique file
//! name and is removed afterwards. Its kind is unique per run too (`test-<id>.gpuplane.dev/gpu`):
//! two spec files in one directory defining the same device make that device unresolvable, and
//! this test may run concurrently with itself or next to a real `nvidia.com/gpu` spec.

use gpuplane::cdi::{self, DriverFiles, Kind, WriteOutcome};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{SystemTime, UNIX_EPOCH};

const CDI_ROOT: &str = "/var/run/cdi";
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

/// Removes the spec file and the image however the test ends.
struct Cleanup {
    stem: String,
    image: Option<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Err(e) = cdi::remove_spec(Path::new(CDI_ROOT), &self.stem) {
            eprintln!("cleanup: {e}");
        }
        if let Some(image) = &self.image {
            let _ = podman(&["rmi", "-f", image]).output();
        }
    }
}

fn mknod_char(path: &Path) {
    // 1:3 is /dev/null: harmless inside and outside the container.
    ok(Command::new("mknod").arg(path).args(["c", "1", "3"]));
}

/// A driver root with one library and one binary, in the places a real driver has them.
fn fake_driver_root(root: &Path) {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    fs::create_dir_all(&lib).unwrap();
    fs::write(
        lib.join("libnvidia-ml.so.550.90.07"),
        format!("{NVML_MARKER}\n"),
    )
    .unwrap();
    let bin = root.join("usr/bin");
    fs::create_dir_all(&bin).unwrap();
    let smi = bin.join("nvidia-smi");
    fs::write(&smi, format!("#!/bin/sh\necho {SMI_MARKER}\n")).unwrap();
    fs::set_permissions(&smi, fs::Permissions::from_mode(0o755)).unwrap();
}

/// `tar` + `podman import` of a directory holding static busybox and a few applet links.
fn import_busybox_image(dir: &Path, tag: &str) {
    let rootfs = dir.join("rootfs");
    let bin = rootfs.join("bin");
    fs::create_dir_all(&bin).unwrap();
    fs::copy("/bin/busybox", bin.join("busybox")).unwrap();
    for applet in ["sh", "ls", "cat", "echo", "test"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
    }
    let tar = dir.join("rootfs.tar");
    ok(Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .arg("-cf")
        .arg(&tar)
        .arg("."));
    let tar = tar.to_str().unwrap().to_string();
    ok(&mut podman(&["import", &tar, tag]));
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

#[test]
fn podman_injects_a_rendered_spec() {
    if !is_root() && skip("needs root (mknod, podman as root)") {
        return;
    }
    if !have("podman", "--version") && skip("podman is not installed") {
        return;
    }
    if !have("runc", "--version") && skip("runc is not installed") {
        return;
    }
    if !Path::new("/bin/busybox").is_file() && skip("/bin/busybox (busybox-static) is missing") {
        return;
    }

    let id = format!(
        "{}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() % 1_000_000_000)
            .unwrap_or(0)
    );
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
    nodes.extend(["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"].map(String::from));

    // Before the nodes exist the agent must not write the spec.
    let files = DriverFiles::discover(&driver_root, &dev_root, &inv);
    assert!(!files.is_complete());
    for n in &nodes {
        mknod_char(&dev_root.join(n));
    }
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
    let image = format!("localhost/gpuplane-busybox:test-{id}");
    let mut cleanup = Cleanup {
        stem: stem.clone(),
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
    let spec_file: PathBuf = Path::new(CDI_ROOT).join(format!("{stem}.json"));
    assert!(spec_file.is_file());

    cleanup.image = Some(image.clone());
    import_busybox_image(tmp.path(), &image);

    let device = format!("{kind}=0");
    let script = "ls -l /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm; \
                  cat /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.90.07; \
                  nvidia-smi; /usr/bin/nvidia-smi; echo VIS=$NVIDIA_VISIBLE_DEVICES; \
                  test -e /dev/nvidia1 && echo LEAKED-nvidia1; true";
    let out = ok(&mut podman(&run_args(&device, &image, script)));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for node in ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"] {
        let line = stdout
            .lines()
            .find(|l| l.ends_with(node))
            .unwrap_or_else(|| panic!("no {node} in:\n{stdout}"));
        assert!(line.starts_with('c'), "{node} is not a char device: {line}");
        assert!(line.contains("1,   3") || line.contains("1, 3"), "{line}");
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
    let out = ok(&mut podman(&run_args(&by_uuid, &image, "ls /dev/nvidia2")));
    assert!(String::from_utf8_lossy(&out.stdout).contains("/dev/nvidia2"));

    // A device the spec does not define is refused.
    let absent = format!("{kind}=9");
    let out = run(&mut podman(&run_args(
        &absent,
        &image,
        "echo SHOULD-NOT-RUN",
    )));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{absent} was accepted");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("SHOULD-NOT-RUN"));
    assert!(stderr.contains("CDI") || stderr.contains("cdi"), "{stderr}");

    drop(cleanup);
    assert!(!spec_file.exists());
}
