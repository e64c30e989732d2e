//! A share's memory held by the driver, not by its container's environment (issue 38): on a
//! driver with per-cgroup GPU memory limits (r615+; the fake libnvidia-ml with
//! `GPUPLANE_FAKE_NVML_DRIVER_VERSION`), the claim's CDI spec carries a `createRuntime` hook.
//! Run as a runtime runs it (the built `gpuplane`, the container's state on stdin, the
//! container's process already in its own cgroup v2 leaf), it sets the limit on that cgroup,
//! and the share's CUDA program (the fake client, through the fake MPS daemon, which asks the
//! driver's state as the real driver enforces it) gets its share even when it unsets or raises
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`. Without the hook, it gets what it asks for: the test
//! fails if the hook sets nothing. Once by hand (the test as the runtime), once through podman
//! and runc (a real CDI consumer running the spec's hook), which also fail the container's
//! creation when the hook cannot hold it.

use crate::cdi_podman::{lacks_prerequisites, spec_file, unique_id, Cleanup};
use crate::dra_shares::{prepare, uid, Env};
use crate::support;
use gpuplane_node::cdi::{MemoryLimitHook, Spec};
use gpuplane_node::dra::core::spec_stem;
use gpuplane_node::dra::ClaimUid;
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

/// The fake driver's settings: where the stand-in MPS daemon leaves its `/dev/shm` segment
/// (clients need it too), the profile Env simulates, its state, a driver with the call.
fn driver_env(env: &Env) -> Vec<(String, String)> {
    vec![
        (
            "GPUPLANE_FAKE_MPS_SHM".into(),
            env.path("shm").display().to_string(),
        ),
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
    std::fs::create_dir_all(env.path("shm")).unwrap();
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

/// [`held_env`] with claim `ns/a` prepared: a 40Gi, 50% share of GPU 0 (the core returned
/// keeps its daemon).
async fn held_share() -> (Env, gpuplane_node::dra::core::DraCore) {
    let env = held_env();
    let core = env.core();
    let a = env.add_claim(
        "a",
        &uid(1),
        &[("gpu-0", Some(("s-a", "40Gi", "50")))],
        json!([]),
    );
    prepare(&core, &a).await.unwrap();
    (env, core)
}

/// Claim `uid`'s one device's spec edits: (hooks, env).
fn share_edits(env: &Env, uid: &str) -> (Vec<gpuplane_node::cdi::Hook>, Vec<String>) {
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
    hook: &gpuplane_node::cdi::Hook,
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
    let (env, _core) = held_share().await;

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
        e.push(driver_env(&env).swap_remove(0));
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

/// Claim `uid`'s spec as written, for podman: a kind of its own (the claim kind's driver is
/// shared by every test), its hooks given the fake driver's settings `driver` (a real driver
/// needs none) or, with `hooks: false`, no hooks; written to the CDI root. Returns the device
/// to ask podman for.
fn podman_spec(
    env: &Env,
    uid: &str,
    id: &str,
    driver: Option<&[(String, String)]>,
    cleanup: &mut Cleanup,
) -> String {
    let stem = spec_stem(&ClaimUid::parse(uid).unwrap());
    let mut spec: Spec =
        serde_json::from_slice(&std::fs::read(env.path(&format!("cdi/{stem}.json"))).unwrap())
            .unwrap();
    spec.kind = format!("test-{id}.gpuplane.dev/share");
    for d in &mut spec.devices {
        match driver {
            Some(vars) => {
                for h in &mut d.container_edits.hooks {
                    h.env = vars.iter().map(|(k, v)| format!("{k}={v}")).collect();
                }
            }
            None => d.container_edits.hooks.clear(),
        }
    }
    let file = format!("gpuplane-test-{id}");
    cleanup.stems.push(file.clone());
    std::fs::write(spec_file(&file), serde_json::to_vec(&spec).unwrap()).unwrap();
    format!("{}={}", spec.kind, spec.devices[0].name)
}

/// `podman run` of `script` in a container with `device`, as runc runs it on a cgroup v2 host:
/// in a mount namespace of its own where this host's cgroup v2 hierarchy is /sys/fs/cgroup
/// (NVIDIA's partitioning needs it there; this project's machines mount it at
/// /sys/fs/cgroup/unified). The container's root is the host's `/` (bound at `root`), so the
/// fake CUDA client runs in it from the build.
fn podman_in_cgroup2(root: &Path, device: &str, shm: &str, script: &str) -> std::process::Output {
    std::fs::create_dir_all(root).unwrap();
    let inner = format!(
        "mount --make-rprivate / && mount --bind {cg} /sys/fs/cgroup && mount --rbind / {root} \
         && exec timeout 180 podman run --rm --runtime runc --network=none \
         --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --pids-limit=0 \
         --device {device} -e GPUPLANE_FAKE_MPS_SHM={shm} --rootfs {root} sh -c \"$0\"",
        cg = cgroup2_root().display(),
        root = root.display(),
    );
    Command::new("unshare")
        .args(["-m", "sh", "-c", &inner, script])
        .output()
        .unwrap()
}

#[tokio::test]
async fn through_podman_and_runc_the_hook_holds_the_container_whatever_it_does_with_its_env() {
    if lacks_prerequisites() {
        return;
    }
    let (env, _core) = held_share().await;
    let id = unique_id();
    let mut cleanup = Cleanup::default();
    let driver = driver_env(&env);
    let shm = env.path("shm").display().to_string();
    let client = support::built_fake_cuda_client().display().to_string();
    let script = format!(
        "unset CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; {client} </dev/null && \
         export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=81920M && {client} </dev/null"
    );
    let root = env.path("root");
    let lines = |out: &std::process::Output| -> Vec<String> {
        assert!(
            out.status.success(),
            "podman: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| pinned(l).to_string())
            .collect()
    };

    // Held: the runtime ran the spec's hook on the container's own cgroup.
    let held = podman_spec(
        &env,
        &uid(1),
        &format!("{id}-held"),
        Some(&driver),
        &mut cleanup,
    );
    let out = podman_in_cgroup2(&root, &held, &shm, &script);
    assert_eq!(lines(&out), ["40960M", "40960M"]);

    // The same spec without its hook: the container gets what its environment asks.
    let bare = podman_spec(&env, &uid(1), &format!("{id}-bare"), None, &mut cleanup);
    let out = podman_in_cgroup2(&root, &bare, &shm, &script);
    assert_eq!(lines(&out), ["unlimited", "81920M"]);

    // A hook that cannot hold (the driver is older than r615) fails the container's creation:
    // its program never runs.
    let old: Vec<(String, String)> = driver
        .iter()
        .filter(|(k, _)| k != "GPUPLANE_FAKE_NVML_DRIVER_VERSION")
        .cloned()
        .collect();
    let refused = podman_spec(
        &env,
        &uid(1),
        &format!("{id}-old"),
        Some(&old),
        &mut cleanup,
    );
    let out = podman_in_cgroup2(&root, &refused, &shm, &script);
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("connected"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("hook"), "{err}");
}
