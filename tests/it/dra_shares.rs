//! Fractional GPUs (DRA consumable capacity) through the DRA core: shares read from the
//! allocation's `consumedCapacity`, held in the one ledger, enforced by an MPS control daemon per
//! shared GPU (the stand-in `nvidia-cuda-mps-control` of hack/fake-mps in the driver root),
//! kept across restarts, and refused with a reason per claim when they cannot be given.

use crate::support;

use gpuplane_model::config::AgentConfig;
use gpuplane_model::inventory::Inventory;
use gpuplane_model::ledger::Holder;
use gpuplane_model::source::{DeviceMode, SimSource};
use gpuplane_node::cdi::Spec;
use gpuplane_node::dra::checkpoint::{self, CheckpointData};
use gpuplane_node::dra::core::{spec_stem, DraCore, DraCoreConfig};
use gpuplane_node::dra::fetch::ClaimFetcher;
use gpuplane_node::dra::service::kubelet_error;
use gpuplane_node::dra::{ClaimRef, ClaimUid, DraDriver};
use gpuplane_node::mps::MpsHost;
use gpuplane_node::paths::HostPaths;
use gpuplane_node::state::{NodeState, Snapshot};
use gpuplane_testkit::doubles::claims::MemoryClaims;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};
use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

pub(crate) const DRIVER: &str = "gpu.gpuplane.dev";
pub(crate) const NODE: &str = "node-a";
const SHARING: &str =
    "sharing:\n  consumableCapacity:\n    gpus: [0, 1]\n    memoryStep: 1Gi\n    computeStep: 10\n";

/// An allocated share: (shareID, consumed memory, consumed compute).
type Share<'a> = (&'a str, &'a str, &'a str);

pub(crate) fn uid(n: u8) -> String {
    format!("0b5c3f2e-1111-4222-8333-4444555566{n:02x}")
}

pub(crate) struct Env {
    dir: tempfile::TempDir,
    pub(crate) inv: Inventory,
    state: Arc<NodeState>,
    claims: Arc<MemoryClaims>,
    /// Where the core runs MPS daemons; unset: as its own processes.
    pub(crate) mps: std::sync::OnceLock<Arc<dyn MpsHost>>,
    /// What the memory-limit hooks run; unset: a driver without per-cgroup limits.
    pub(crate) memory_limits: std::sync::OnceLock<gpuplane_node::cdi::MemoryLimitHook>,
}

impl Env {
    /// A simulated dgx-a100 (80Gi GPUs) sharing GPUs 0 and 1; with the stand-in MPS control
    /// program in the driver root when `mps`.
    pub(crate) fn new(mps: bool) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let inv = gpuplane_model::sim::load("dgx-a100").unwrap();
        fs::create_dir_all(root.join("proc/sys/kernel/random")).unwrap();
        fs::write(root.join("proc/sys/kernel/random/boot_id"), "boot-1\n").unwrap();
        let bin = root.join("driver/usr/bin");
        fs::create_dir_all(&bin).unwrap();
        if mps {
            std::os::unix::fs::symlink(
                support::built_fake_mps(),
                bin.join("nvidia-cuda-mps-control"),
            )
            .unwrap();
        }
        let config = AgentConfig::parse("test", SHARING).unwrap();
        let snapshot = Snapshot::new(inv.clone(), config).unwrap();
        Env {
            dir,
            inv,
            state: Arc::new(NodeState::new(snapshot)),
            claims: Arc::new(MemoryClaims::default()),
            mps: std::sync::OnceLock::new(),
            memory_limits: std::sync::OnceLock::new(),
        }
    }

    pub(crate) fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    pub(crate) fn core(&self) -> DraCore {
        self.core_on(self.state.clone())
    }

    /// A core on `state` over this env's files (a restarted agent brings a new state).
    fn core_on(&self, state: Arc<NodeState>) -> DraCore {
        let root = self.dir.path();
        // The real /proc: the daemons' PIDs are checked there.
        let config = DraCoreConfig {
            driver: DRIVER.into(),
            node_name: NODE.into(),
            paths: HostPaths {
                proc_root: PathBuf::from("/proc"),
                ..HostPaths::under(root)
            },
            device_mode: DeviceMode::Simulated,
            mps: self.mps.get().cloned(),
            memory_limits: self.memory_limits.get().cloned(),
        };
        let fetcher: Arc<dyn ClaimFetcher> = self.claims.clone();
        let source = Arc::new(SimSource::new(self.inv.clone()));
        DraCore::new(config, state, fetcher, source).unwrap()
    }

    pub(crate) fn gpu(&self, i: usize) -> String {
        self.inv.gpus[i].uuid.to_string()
    }

    /// Adds claim `ns/<name>` allocated `results`: (device, Some((shareID, memory, compute)))
    /// for a share, None for a whole device; `config`: the allocation's configs.
    pub(crate) fn add_claim(
        &self,
        name: &str,
        uid: &str,
        results: &[(&str, Option<Share<'_>>)],
        config: Value,
    ) -> ClaimRef {
        let results: Vec<Value> = results
            .iter()
            .map(|(d, share)| {
                let mut r = json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": d});
                if let Some((id, memory, compute)) = share {
                    r["shareID"] = json!(id);
                    r["consumedCapacity"] = json!({"memory": memory, "compute": compute});
                }
                r
            })
            .collect();
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap();
        self.claims.insert(claim);
        ClaimRef::parse("ns", uid, name).unwrap()
    }

    pub(crate) fn spec_env(&self, uid: &str) -> Vec<String> {
        let stem = spec_stem(&ClaimUid::parse(uid).unwrap());
        let spec: Spec =
            serde_json::from_slice(&fs::read(self.path(&format!("cdi/{stem}.json"))).unwrap())
                .unwrap();
        spec.devices
            .iter()
            .flat_map(|d| d.container_edits.env.clone())
            .collect()
    }

    /// Runs the fake CUDA client as user `user` with the environment claim `uid`'s spec gives
    /// its container (plus `extra`), as that share's program would; it holds its connection
    /// until it is dropped.
    pub(crate) fn cuda_client(&self, uid: &str, user: u32, extra: &[(&str, &str)]) -> CudaClient {
        use std::os::unix::process::CommandExt;
        let env: Vec<(String, String)> = self
            .spec_env(uid)
            .iter()
            .filter_map(|v| v.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        // Other users cannot run the build's copy when the checkout sits in a private (0700)
        // directory, as a fresh `mktemp -d` clone does: they run one in this node's directory.
        let exe = self.path("fake-cuda-client");
        if !exe.exists() {
            fs::copy(support::built_fake_cuda_client(), &exe).unwrap();
        }
        let mut cmd = std::process::Command::new(exe);
        cmd.env_clear()
            .envs(env)
            .envs(extra.iter().copied())
            .uid(user)
            .gid(user)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = spawn_fresh_copy(&mut cmd);
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line);
            let _ = tx.send(line);
        });
        CudaClient { child, first: rx }
    }

    fn pid_file(&self, gpu: usize) -> PathBuf {
        self.path(&format!(
            "state/mps/{}/pipe/nvidia-cuda-mps-control.pid",
            self.gpu(gpu)
        ))
    }

    pub(crate) fn daemon_pid(&self, gpu: usize) -> Option<u32> {
        let pid: u32 = fs::read_to_string(self.pid_file(gpu))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        PathBuf::from(format!("/proc/{pid}"))
            .exists()
            .then_some(pid)
    }

    fn daemon_log(&self, gpu: usize) -> String {
        fs::read_to_string(self.path(&format!("state/mps/{}/log/control.log", self.gpu(gpu))))
            .unwrap_or_default()
    }

    /// The checkpoint's content; empty before the first write.
    fn checkpoint(&self) -> CheckpointData {
        checkpoint::read(&self.path("state")).unwrap_or_else(|| CheckpointData::empty("none"))
    }

    /// Claim `name`'s first `status.devices` entry, once the background write made it.
    pub(crate) async fn device_status(&self, name: &str) -> Value {
        for _ in 0..500 {
            let claim = self.claims.get("ns", name).await.unwrap();
            if let Some(d) = claim
                .status
                .and_then(|s| s.devices)
                .and_then(|d| d.into_iter().next())
            {
                return serde_json::to_value(d).unwrap();
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("no status.devices on claim {name}");
    }

    fn share_holders(&self, gpu: usize) -> Vec<String> {
        let snap = self.state.read();
        snap.ledger
            .shares_of(&self.gpu(gpu))
            .iter()
            .map(|s| match &s.holder {
                Holder::Claim { name, .. } => format!("{name} {}", s.share),
                other => other.to_string(),
            })
            .collect()
    }
}

impl Drop for Env {
    /// No stand-in daemon outlives its test.
    fn drop(&mut self) {
        for gpu in 0..self.inv.gpus.len() {
            if let Some(pid) = self.daemon_pid(gpu) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
}

/// A running fake CUDA client ([`Env::cuda_client`]); killed when dropped.
pub(crate) struct CudaClient {
    child: std::process::Child,
    first: std::sync::mpsc::Receiver<String>,
}

impl CudaClient {
    /// Its exit status once it ends by itself; a hang guard, not a timing assertion.
    pub(crate) fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the client did not end within 30 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Whether it still holds its connection (or waits for one).
    pub(crate) fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// The limits it reported when it connected: (compute percent, memory limit); a hang
    /// guard, not a timing assertion.
    pub(crate) fn limits(&self) -> (String, String) {
        let line = self
            .first
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the client connected within 30 s");
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in {line:?}"))
                .to_string()
        };
        (
            field("active-thread-percentage="),
            field("pinned-mem-limit="),
        )
    }
}

impl Drop for CudaClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns a program this test process has just copied. A child another thread forked while
/// the copy was open for writing holds that descriptor until its own exec, and until then the
/// kernel refuses to run the file (ETXTBSY, rust-lang/rust#114554): try again once that child
/// has exec'd, which takes no more than a moment.
fn spawn_fresh_copy(cmd: &mut std::process::Command) -> std::process::Child {
    const ETXTBSY: i32 = 26;
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match cmd.spawn() {
            Ok(child) => return child,
            Err(e) if e.raw_os_error() == Some(ETXTBSY) && Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => panic!("spawning {cmd:?}: {e}"),
        }
    }
}

pub(crate) fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}

pub(crate) async fn prepare(core: &DraCore, c: &ClaimRef) -> Result<(), String> {
    // The error as the kubelet gets it, from the gRPC edge.
    let mut out = core.prepare(vec![c.clone()]).await;
    out.remove(&c.uid)
        .unwrap()
        .map(|_| ())
        .map_err(|e| kubelet_error(c, &e))
}

pub(crate) async fn unprepare(core: &DraCore, c: &ClaimRef) {
    let mut out = core.unprepare(vec![c.clone()]).await;
    out.remove(&c.uid).unwrap().unwrap();
}

#[tokio::test]
async fn two_shares_fill_a_gpu_under_one_mps_daemon_which_stops_after_the_last() {
    let env = Env::new(true);
    let core = env.core();
    let a = env.add_claim(
        "a",
        &uid(1),
        &[("gpu-0", Some(("s-a", "40Gi", "50")))],
        json!([]),
    );
    let b = env.add_claim(
        "b",
        &uid(2),
        &[("gpu-0", Some(("s-b", "40Gi", "50")))],
        json!([]),
    );
    prepare(&core, &a).await.unwrap();
    let first = env
        .daemon_pid(0)
        .expect("the first share starts the GPU's daemon");
    prepare(&core, &b).await.unwrap();
    assert_eq!(
        env.daemon_pid(0),
        Some(first),
        "one daemon serves both shares"
    );
    let log = env.daemon_log(0);
    assert_eq!(log.matches(" start ").count(), 1, "{log}");
    assert!(
        log.contains(&format!("CUDA_VISIBLE_DEVICES={}", env.gpu(0))),
        "{log}"
    );
    assert_eq!(
        env.share_holders(0),
        [
            "ns/a 40Gi memory, 50% compute",
            "ns/b 40Gi memory, 50% compute"
        ]
    );
    each_share_finds_the_daemon_and_its_limits_in_its_environment(&env);
    the_share_limits_are_cooperative(&env).await;

    // Full: a third share is refused, naming the holders; nothing of it is left.
    let c = env.add_claim(
        "c",
        &uid(3),
        &[("gpu-0", Some(("s-c", "1Gi", "10")))],
        json!([]),
    );
    let err = prepare(&core, &c).await.unwrap_err();
    assert!(
        err.contains("ResourceClaim ns/a") && err.contains("ResourceClaim ns/b"),
        "{err}"
    );
    assert!(err.contains("0 memory and 0% compute are free"), "{err}");
    assert!(!env.checkpoint().claims.contains_key(&uid(3)));
    // A whole-GPU claim (or the device plugin) gets no share of it either.
    let w = env.add_claim("w", &uid(4), &[("gpu-0", None)], json!([]));
    let err = prepare(&core, &w).await.unwrap_err();
    assert!(err.contains("ResourceClaim ns/a"), "{err}");

    unprepare(&core, &a).await;
    assert_eq!(env.daemon_pid(0), Some(first), "b still runs on it");
    unprepare(&core, &b).await;
    assert_eq!(env.daemon_pid(0), None, "the last share stops the daemon");
    assert!(!env.path(&format!("state/mps/{}", env.gpu(0))).exists());
    assert!(env.share_holders(0).is_empty());
    // Whole again.
    prepare(&core, &w).await.unwrap();
    assert!(env.daemon_pid(0).is_none(), "a whole GPU runs no daemon");
}

/// Each of the two shares' containers finds the GPU's MPS pipe and its share (50% compute,
/// 40Gi) in the environment of its CDI spec.
fn each_share_finds_the_daemon_and_its_limits_in_its_environment(env: &Env) {
    let pipe = env.path(&format!("state/mps/{}/pipe", env.gpu(0)));
    for uid in [uid(1), uid(2)] {
        let e = env.spec_env(&uid);
        for want in [
            format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe.display()),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50".into(),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40960M".into(),
            "GPUPLANE_SHARE_ENFORCEMENT=MPS".into(),
            format!("GPUPLANE_DEVICE_0=index=0,uuid={}", env.gpu(0)),
        ] {
            assert!(
                e.iter().any(|v| v == &want || v.starts_with(&want)),
                "{want} missing in {e:?}"
            );
        }
    }
}

/// The status tells the user the share, and that its limits are not enforced; where users can
/// be switched, the shares' programs get their limits and a container may raise them.
async fn the_share_limits_are_cooperative(env: &Env) {
    // The status tells the user the share, and that its limits are not enforced: they live
    // in the container's environment, which the container controls.
    let status = env.device_status("a").await;
    assert_eq!(status["shareID"], "s-a");
    assert_eq!(status["data"]["share"]["memory"], "40Gi");
    let condition = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "ShareLimitsEnforced")
        .cloned()
        .unwrap();
    assert_eq!(condition["status"], "False", "{condition}");
    assert!(
        condition["message"]
            .as_str()
            .unwrap()
            .contains("cooperative only"),
        "{condition}"
    );
    if can_switch_users() {
        // The two shares' programs, of two users, connect at once (a multi-user daemon on this
        // Ampere GPU), each given its share by its environment ...
        std::fs::set_permissions(
            env.dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let (ca, cb) = (
            env.cuda_client(&uid(1), 1000, &[]),
            env.cuda_client(&uid(2), 1001, &[]),
        );
        assert_eq!(ca.limits(), ("50.0".into(), "40960M".into()));
        assert_eq!(cb.limits(), ("50.0".into(), "40960M".into()));
        // ... which a container may raise: what the condition says.
        let greedy = env.cuda_client(
            &uid(1),
            1000,
            &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")],
        );
        assert_eq!(greedy.limits().0, "100.0");
    }
}

#[tokio::test]
async fn a_restarted_agent_adopts_the_daemon_restarts_a_missing_one_and_stops_a_stray_one() {
    let env = Env::new(true);
    let a = env.add_claim(
        "a",
        &uid(1),
        &[("gpu-0", Some(("s-a", "20Gi", "30")))],
        json!([]),
    );
    let b = env.add_claim(
        "b",
        &uid(2),
        &[("gpu-1", Some(("s-b", "20Gi", "30")))],
        json!([]),
    );
    {
        let core = env.core();
        prepare(&core, &a).await.unwrap();
        prepare(&core, &b).await.unwrap();
    }
    let adopted = env.daemon_pid(0).unwrap();
    // gpu-1's daemon died while the agent was down; a stray daemon dir (a crash between a
    // start and the checkpoint write) holds no share.
    let killed = env.daemon_pid(1).unwrap();
    std::process::Command::new("kill")
        .args(["-KILL", &killed.to_string()])
        .status()
        .unwrap();
    while alive(killed) {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let stray = env.path(&format!("state/mps/{}", env.gpu(2)));
    fs::create_dir_all(stray.join("pipe")).unwrap();

    // A new agent on the same state: holds and daemons come back before any prepare.
    let state = Arc::new(NodeState::new(
        Snapshot::new(
            env.inv.clone(),
            AgentConfig::parse("test", SHARING).unwrap(),
        )
        .unwrap(),
    ));
    let core = env.core_on(state.clone());
    let started = Instant::now();
    core.restore_holds().await;
    assert_eq!(
        env.daemon_pid(0),
        Some(adopted),
        "a running daemon is adopted"
    );
    let restarted = env
        .daemon_pid(1)
        .expect("a missing daemon is started again");
    assert_ne!(restarted, killed);
    assert!(!stray.exists(), "a daemon dir with no share is removed");
    assert_eq!(state.read().ledger.shares_of(&env.gpu(0)).len(), 1);
    eprintln!("restore with daemons: {:?}", started.elapsed());
    // Prepared shares answer from the checkpoint, and a daemon that died since is started
    // again before the answer; unprepare stops the daemons.
    let died = env.daemon_pid(0).unwrap();
    std::process::Command::new("kill")
        .args(["-KILL", &died.to_string()])
        .status()
        .unwrap();
    while alive(died) {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    prepare(&core, &a).await.unwrap();
    assert!(
        env.daemon_pid(0).is_some_and(|p| p != died),
        "a new daemon for gpu-0"
    );
    unprepare(&core, &a).await;
    unprepare(&core, &b).await;
    assert_eq!((env.daemon_pid(0), env.daemon_pid(1)), (None, None));
}

#[tokio::test]
async fn shares_that_cannot_be_given_are_refused_per_claim_with_nothing_half_prepared() {
    let env = Env::new(true);
    let core = env.core();
    let mps_config = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing"}}}}]);
    let cases = [
        // gpu-2 is not shared on this node.
        (
            env.add_claim(
                "n",
                &uid(1),
                &[("gpu-2", Some(("s", "10Gi", "10")))],
                json!([]),
            ),
            "this node does not share it",
        ),
        // Not on the published grid.
        (
            env.add_claim(
                "g",
                &uid(2),
                &[("gpu-0", Some(("s", "1536Mi", "10")))],
                json!([]),
            ),
            "multiples of 1Gi up to 80Gi",
        ),
        (
            env.add_claim(
                "p",
                &uid(3),
                &[("gpu-0", Some(("s", "1Gi", "15")))],
                json!([]),
            ),
            "compute shares are multiples of 10",
        ),
        // An opaque config with its own sharing contradicts the share.
        (
            env.add_claim(
                "o",
                &uid(4),
                &[("gpu-0", Some(("s", "1Gi", "10")))],
                mps_config,
            ),
            "remove the sharing settings",
        ),
        // Under MPS a share is its claim's only device.
        (
            env.add_claim(
                "m",
                &uid(5),
                &[("gpu-0", Some(("s", "1Gi", "10"))), ("gpu-3", None)],
                json!([]),
            ),
            "an MPS share must be its claim's only device",
        ),
    ];
    for (c, why) in &cases {
        let err = prepare(&core, c).await.unwrap_err();
        assert!(err.contains(&format!("claim ns/{}", c.name)), "{err}");
        assert!(err.contains(why), "{why}: {err}");
    }
    assert!(env.checkpoint().claims.is_empty(), "nothing recorded");
    assert!(env.share_holders(0).is_empty(), "nothing held");
    assert_eq!(env.daemon_pid(0), None, "no daemon started");
    assert!(fs::read_dir(env.path("cdi"))
        .map(|d| d.count() == 0)
        .unwrap_or(true));
}

#[tokio::test]
async fn without_the_mps_program_a_share_is_time_sliced_and_says_its_limits_are_not_enforced() {
    let env = Env::new(false);
    let core = env.core();
    let a = env.add_claim(
        "a",
        &uid(1),
        &[("gpu-1", Some(("s-a", "8Gi", "20")))],
        json!([]),
    );
    prepare(&core, &a).await.unwrap();
    let e = env.spec_env(&uid(1));
    assert!(
        e.contains(&"GPUPLANE_SHARE_ENFORCEMENT=TimeSlicing".to_string()),
        "{e:?}"
    );
    assert!(
        e.contains(&"GPUPLANE_SHARE_MEMORY=8Gi".to_string()),
        "{e:?}"
    );
    assert!(!e.iter().any(|v| v.starts_with("CUDA_MPS_")), "{e:?}");
    let status = env.device_status("a").await;
    let cond = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "ShareLimitsEnforced")
        .cloned()
        .unwrap();
    assert_eq!(
        (cond["status"].as_str(), cond["reason"].as_str()),
        (Some("False"), Some("TimeSlicing"))
    );
    let notice = core
        .share_notice(&uid(1))
        .await
        .expect("an Event for the user");
    assert_eq!(notice.reason, "ShareLimitsNotEnforced");
    assert!(
        notice.note.contains("gpu-1 (8Gi memory, 20% compute)"),
        "{}",
        notice.note
    );
    assert_eq!(env.share_holders(1).len(), 1);
}

/// Running clients as other users needs root; under CI it may not skip.
fn can_switch_users() -> bool {
    let root = fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    if !root {
        assert!(
            std::env::var_os("CI").is_none(),
            "running share programs as other users needs root (CI is set, so this is a failure)"
        );
        eprintln!("SKIPPED: running share programs as other users needs root");
    }
    root
}

/// The YAML blocks of a docs section, in order.
fn yaml_blocks(section: &str) -> Vec<&str> {
    section
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split_once("```").map(|(block, _)| block))
        .collect()
}

/// docs/mig-and-sharing.md's fractional-GPU example holds on the bundled `dgx-h100` (H100 80GB,
/// 81559Mi): its config block is what the agent reads, its device block is what the agent
/// publishes for GPU 0, its claim is a share the policy allows, and the sizes its text says fit
/// on one GPU fit while those it says do not, do not.
#[test]
fn the_sharing_docs_example_is_what_a_dgx_h100_publishes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = fs::read_to_string(root.join("docs/mig-and-sharing.md")).unwrap();
    let section = doc
        .split_once("## Fractional GPUs")
        .and_then(|(_, rest)| rest.split_once("\n## "))
        .map(|(s, _)| s)
        .expect("docs/mig-and-sharing.md has the fractional GPU section");
    let blocks = yaml_blocks(section);
    assert!(
        blocks.len() >= 3,
        "config, device and claim blocks: {blocks:?}"
    );
    let config = AgentConfig::parse("docs", blocks[0]).unwrap();
    let inv = gpuplane_model::sim::load("dgx-h100").unwrap();
    let shared = gpuplane_model::sharing::shared_units(&inv, config.shares.as_ref());
    let mut health = gpuplane_model::health::HealthBook::default();
    health.set_inventory(&inv);
    let slices = gpuplane_node::slices::render::render_with_generation(
        &inv, &health, DRIVER, NODE, 0, &shared,
    );
    let published: Value = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == "gpu-0")
        .map(|d| serde_json::to_value(d).unwrap())
        .expect("gpu-0 is published");
    let documented: Value = serde_yaml_ng::from_str(blocks[1]).unwrap();
    assert_eq!(documented[0]["name"], "gpu-0");
    for field in ["allowMultipleAllocations", "capacity"] {
        assert_eq!(
            documented[0][field], published[field],
            "docs/mig-and-sharing.md's {field} of gpu-0 is not what a dgx-h100 publishes"
        );
    }
    let claim: Value = serde_yaml_ng::from_str(blocks[2]).unwrap();
    let asked = &claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"];
    let unit = shared.get(&inv.gpus[0].uuid).expect("gpu-0 is shared");
    let gi = |n: u64| n << 30;
    let quantity = |v: &Value| {
        let q = gpuplane_model::quantity::Quantity::parse(v.as_str().unwrap()).unwrap();
        u64::try_from(q.value().unwrap()).unwrap()
    };
    // Rounded up to the steps, as the scheduler does (the docs' 25 becomes 30).
    let compute = u32::try_from(quantity(&asked["compute"])).unwrap();
    let share = gpuplane_model::sharing::Share {
        memory: quantity(&asked["memory"]).div_ceil(unit.memory_step) * unit.memory_step,
        compute: compute.div_ceil(unit.compute_step) * unit.compute_step,
    };
    unit.check(&share).unwrap();
    // The text's sizes: two 39Gi fit on one GPU, two 40Gi do not, and the default is 79Gi.
    assert!(section.contains("Two `39Gi` claims share one GPU"));
    assert!(section.contains("two `40Gi` claims do not"));
    assert!(2 * gi(39) <= unit.memory && 2 * gi(40) > unit.memory);
    assert_eq!(unit.max_memory(), gi(79));
}
