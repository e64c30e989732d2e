//! A share's memory held by the driver, not by its container's environment (issue 38): on a
//! driver with per-cgroup GPU memory limits (r615+; the fake libnvidia-ml with
//! `GPUPLANE_FAKE_NVML_DRIVER_VERSION`), the claim's CDI spec carries a `createRuntime` hook.
//! Run as a runtime runs it (the built `gpuplane`, the container's state on stdin, the
//! container's process already in its own cgroup v2 leaf), it sets the limit on that cgroup,
//! and the share's CUDA program (the fake client, through the fake MPS daemon, which asks the
//! driver's state as the real driver enforces it) gets its share even when it unsets or raises
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`. Without the hook, it gets what it asks for: the test
//! fails if the hook sets nothing.

use crate::dra_shares::{prepare, uid, Env};
use crate::support;
use gpuplane_shell::cdi::{MemoryLimitHook, Spec};
use gpuplane_shell::dra::core::spec_stem;
use gpuplane_shell::dra::ClaimUid;
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const DRIVER_R615: &str = "615.20.01";

/// Where this host mounts cgroup v2: /sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid
/// host (this project's machines mount v1 controllers at /sys/fs/cgroup).
fn cgroup2_root() -> PathBuf {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return root.to_path_buf();
    }
    let unified = root.join("unified");
    assert!(
        unified.join("cgroup.controllers").exists(),
        "this test needs cgroup v2 at /sys/fs/cgroup or /sys/fs/cgroup/unified"
    );
    unified
}

/// A cgroup v2 leaf of its own, as a runtime makes for a container; removed when dropped.
struct Leaf(PathBuf);

impl Leaf {
    fn new(name: &str) -> Leaf {
        let dir = cgroup2_root().join(format!("gpuplane-it-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Leaf(dir)
    }

    fn adopt(&self, pid: u32) {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for Leaf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The fake driver's settings: the profile Env simulates, its state, a driver with the call.
fn driver_env(env: &Env) -> Vec<(String, String)> {
    vec![
        ("GPUPLANE_FAKE_NVML_PROFILE".into(), "dgx-a100".into()),
        (
            "GPUPLANE_FAKE_NVML_STATE".into(),
            env.path("nvml-state.json").display().to_string(),
        ),
        (
            "GPUPLANE_FAKE_NVML_DRIVER_VERSION".into(),
            DRIVER_R615.into(),
        ),
    ]
}

/// Env whose stand-in MPS daemon reads the fake driver's state, as the real server's
/// allocations meet the driver's limits.
fn held_env() -> Env {
    let env = Env::new(true);
    let program = env.path("driver/usr/bin/nvidia-cuda-mps-control");
    std::fs::remove_file(&program).unwrap();
    let exports: String = driver_env(&env)
        .iter()
        .map(|(k, v)| format!("export {k}='{v}'\n"))
        .collect();
    std::fs::write(
        &program,
        format!(
            "#!/bin/sh\n{exports}exec '{}' \"$@\"\n",
            support::built_fake_mps().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &program,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    env.memory_limits
        .set(MemoryLimitHook {
            exe: env!("CARGO_BIN_EXE_gpuplane").into(),
            nvml_lib: support::built_fake().display().to_string(),
        })
        .unwrap();
    env
}

/// Claim `uid`'s one device's spec edits: (hooks, env).
fn share_edits(env: &Env, uid: &str) -> (Vec<gpuplane_shell::cdi::Hook>, Vec<String>) {
    let stem = spec_stem(&ClaimUid::parse(uid).unwrap());
    let spec: Spec =
        serde_json::from_slice(&std::fs::read(env.path(&format!("cdi/{stem}.json"))).unwrap())
            .unwrap();
    let edits = &spec.devices[0].container_edits;
    (edits.hooks.clone(), edits.env.clone())
}

/// A share container's process, created but not yet running its program (a shell waiting for
/// a line), in `leaf`; `go` lets it exec the fake CUDA client with `env`.
struct Container {
    child: Child,
}

impl Container {
    fn create(leaf: &Leaf, env: &[(String, String)]) -> Container {
        let child = Command::new("sh")
            .args([
                "-c",
                "read _ && exec \"$0\"",
                support::built_fake_cuda_client().to_str().unwrap(),
            ])
            .env_clear()
            .envs(env.iter().cloned())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        leaf.adopt(child.id());
        Container { child }
    }

    /// Runs the program and returns the line it printed on connecting (its stdin stays open,
    /// so it holds its connection until dropped).
    fn start(&mut self) -> String {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        BufReader::new(self.child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        line
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `hook` as a runtime does at createRuntime for the container with init process `pid`.
fn run_hook(
    hook: &gpuplane_shell::cdi::Hook,
    pid: u32,
    driver: &[(String, String)],
) -> std::process::Output {
    let mut child = Command::new(&hook.path)
        .args(&hook.args[1..])
        .args(["--cgroup-root", cgroup2_root().to_str().unwrap()])
        .envs(driver.iter().cloned())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let state = json!({"ociVersion": "1.2.0", "id": "ctr-1", "status": "creating", "pid": pid, "bundle": "/b"});
    child
        .stdin
        .take()
        .unwrap()
        .write_all(state.to_string().as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn pinned(line: &str) -> &str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("pinned-mem-limit="))
        .unwrap_or_else(|| panic!("no pinned-mem-limit in {line:?}"))
}

#[tokio::test]
async fn a_share_container_that_drops_or_raises_its_memory_limit_is_still_held_to_its_share() {
    let env = held_env();
    let core = env.core();
    let a = env.add_claim(
        "a",
        &uid(1),
        &[("gpu-0", Some(("s-a", "40Gi", "50")))],
        json!([]),
    );
    prepare(&core, &a).await.unwrap();

    let (hooks, spec_env) = share_edits(&env, &uid(1));
    assert_eq!(hooks.len(), 1, "{hooks:?}");
    let hook = &hooks[0];
    assert_eq!(hook.hook_name, "createRuntime");
    let args = hook.args.join(" ");
    assert!(
        args.contains(&format!(
            "--device {} --limit-bytes {}",
            env.gpu(0),
            40u64 << 30
        )),
        "{args}"
    );

    // The container drops its memory limit, or raises it to the whole GPU.
    let container_env = |pinned: Option<&str>| -> Vec<(String, String)> {
        let mut e: Vec<(String, String)> = spec_env
            .iter()
            .filter_map(|v| v.split_once('='))
            .filter(|(k, _)| *k != "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if let Some(p) = pinned {
            e.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), p.into()));
        }
        e
    };
    let driver = driver_env(&env);

    // Without the hook the driver holds nothing: the container gets what it asks for.
    let bare = Leaf::new("bare");
    let mut unheld = Container::create(&bare, &container_env(None));
    assert_eq!(pinned(&unheld.start()), "unlimited");

    for (name, asks) in [("unset", None), ("raised", Some("0=81920M"))] {
        let leaf = Leaf::new(name);
        let mut container = Container::create(&leaf, &container_env(asks));
        let out = run_hook(hook, container.child.id(), &driver);
        assert!(
            out.status.success(),
            "the hook failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(pinned(&container.start()), "40960M", "container {name}");
    }
    // The limits went on those containers' own cgroups, not on a cgroup above others.
    let after = Leaf::new("after");
    let mut other = Container::create(&after, &container_env(None));
    assert_eq!(pinned(&other.start()), "unlimited");

    // The claim says which limit holds and which does not.
    let status = env.device_status("a").await;
    assert_eq!(status["data"]["share"]["memoryHeld"], true, "{status}");
    let condition = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "ShareLimitsEnforced")
        .cloned()
        .unwrap();
    assert_eq!(condition["status"], "False", "{condition}");
    assert_eq!(condition["reason"], "ComputeCooperative", "{condition}");
}

#[test]
fn the_hook_refuses_what_it_cannot_hold_and_says_why() {
    let env = held_env();
    let hook = env.memory_limits.get().unwrap().hook(&env.gpu(0), 1 << 30);
    let leaf = Leaf::new("refused");
    let container = Container::create(&leaf, &[]);
    // A driver before r615 has no per-cgroup limit: the container must not start unheld.
    let old: Vec<(String, String)> = driver_env(&env)
        .into_iter()
        .filter(|(k, _)| k != "GPUPLANE_FAKE_NVML_DRIVER_VERSION")
        .collect();
    let out = run_hook(&hook, container.child.id(), &old);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("r615"), "{err}");
    // Run by hand, with no container state.
    let out = Command::new(&hook.path)
        .args(&hook.args[1..])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("container runtime"), "{err}");
}
