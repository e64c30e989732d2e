//! The test image of gpuplane, made offline (no registry, no base image): the binary the
//! Dockerfile builds (`--no-default-features`; hack/test.sh builds it into
//! `target/<profile>/image/gpuplane`) and the shared libraries `ldd` says it links (glibc,
//! libgcc_s, the loader), written as an OCI image layout by hack/cluster/oci-image.py and
//! imported into each lab node's containerd. What the image must share with the users' image
//! (binary path, entrypoint, user) is stated here once and compared with the Dockerfile by a
//! test, so the two cannot drift.

use super::repo;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository of the test image; the tag names the build.
pub const REPOSITORY: &str = "lab.local/gpuplane";
/// Where the binary lives in the image.
pub const BINARY: &str = "/usr/bin/gpuplane";
/// The image's user: distroless' nonroot (the DaemonSet runs the agent as root).
pub const USER: &str = "65532:65532";

/// The image binary, or why it is missing.
pub fn binary() -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_BIN_EXE_gpuplane"))
        .parent()
        .ok_or("no target dir")?;
    let bin = dir.join("image/gpuplane");
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!(
            "{} is not built: hack/test.sh builds it (cargo build -p gpuplane --bin gpuplane \
             --no-default-features, copied there before the test build)",
            bin.display()
        ))
    }
}

/// A built test image: its reference and the tar `ctr images import` takes.
pub struct TestImage {
    pub reference: String,
    pub tar: PathBuf,
}

/// The shared libraries `binary` links, as (path it is loaded from, file to copy).
fn linked_libraries(binary: &Path) -> Vec<(String, PathBuf)> {
    let out = Command::new("ldd").arg(binary).output().expect("run ldd");
    assert!(out.status.success(), "ldd {}", binary.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or the loader's
            // `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has no file.
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| {
                let file = std::fs::canonicalize(path).expect("a linked library's file");
                (path.to_string(), file)
            })
        })
        .collect()
}

/// Builds `lab.local/gpuplane:<tag>` from the image binary into `work/gpuplane-<tag>.tar`.
/// `stamp` becomes the image's `GPUPLANE_BUILD` environment variable, which the agent logs at
/// start: two builds of one binary that a rollout can tell apart.
pub fn build(work: &Path, tag: &str, stamp: &str) -> Result<TestImage, String> {
    let binary = binary()?;
    let reference = format!("{REPOSITORY}:{tag}");
    let tar = work.join(format!("gpuplane-{tag}.tar"));
    let mut cmd = Command::new("python3");
    cmd.arg(repo().join("hack/cluster/oci-image.py"))
        .arg(&tar)
        .args(["--name", &reference])
        .args(["--entrypoint", &format!("[\"{BINARY}\"]")])
        .args(["--user", USER])
        .args(["--env", "PATH=/usr/bin:/bin"])
        .args(["--env", &format!("GPUPLANE_BUILD={stamp}")])
        .args(["--dir", "/tmp"])
        .arg("--file")
        .arg(format!("{}:{BINARY}", binary.display()));
    for (at, file) in linked_libraries(&binary) {
        cmd.arg("--file").arg(format!("{}:{at}", file.display()));
    }
    let out = cmd.output().map_err(|e| format!("run oci-image.py: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "oci-image.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(TestImage { reference, tar })
}

/// What the Dockerfile's final stage gives the users' image: the binary's path (its COPY
/// destination), USER and ENTRYPOINT.
pub struct DockerfileRuntime {
    pub binary: String,
    pub user: String,
    pub entrypoint: Vec<String>,
}

pub fn dockerfile_runtime() -> DockerfileRuntime {
    let text = std::fs::read_to_string(repo().join("Dockerfile")).expect("read the Dockerfile");
    let last = text
        .rsplit_once("\nFROM ")
        .map(|(_, s)| s)
        .expect("a final stage");
    let instruction = |name: &str| {
        last.lines()
            .find_map(|l| l.strip_prefix(name).map(|r| r.trim().to_string()))
            .unwrap_or_else(|| panic!("no {name} in the Dockerfile's final stage"))
    };
    let copy = instruction("COPY ");
    DockerfileRuntime {
        binary: copy
            .split_whitespace()
            .last()
            .unwrap_or_default()
            .to_string(),
        user: instruction("USER "),
        entrypoint: serde_json::from_str(&instruction("ENTRYPOINT "))
            .expect("exec-form ENTRYPOINT"),
    }
}

/// The config of the one image in an OCI layout tar: (Entrypoint, User, files in the layer).
pub fn image_config(tar: &Path) -> (Vec<String>, String, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let st = Command::new("tar")
        .arg("-C")
        .arg(dir.path())
        .arg("-xf")
        .arg(tar)
        .status()
        .unwrap();
    assert!(st.success());
    let read = |p: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    let blob = |digest: &serde_json::Value| {
        let d = digest.as_str().unwrap().trim_start_matches("sha256:");
        read(&dir.path().join("blobs/sha256").join(d))
    };
    let index = read(&dir.path().join("index.json"));
    let manifest = blob(&index["manifests"][0]["digest"]);
    let config = blob(&manifest["config"]["digest"]);
    let c = &config["config"];
    let entrypoint = serde_json::from_value(c["Entrypoint"].clone()).unwrap_or_default();
    let user = c["User"].as_str().unwrap_or("").to_string();
    let files = serde_json::from_str(c["Labels"]["dev.gpuplane.files"].as_str().unwrap_or("[]"))
        .unwrap_or_default();
    (entrypoint, user, files)
}
