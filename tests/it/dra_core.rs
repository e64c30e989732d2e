//! The DRA core driven through the `DraDriver` trait: simulated hardware (`a100-mig-mixed`),
//! ResourceClaims served from memory, CDI specs, checkpoint and device nodes in a temp dir.
//!
//! Most tests run the core as on real hardware (`DeviceMode::Hardware`): the device nodes are
//! character devices with the NVIDIA driver's numbers, made with mknod, so they need root and
//! skip without it. The simulated mode needs no nodes.

use gpuplane_model::config::AgentConfig;
use gpuplane_model::inventory::{DeviceRef, Inventory};
use gpuplane_model::source::{DeviceMode, SimSource};
use gpuplane_node::cdi::Spec;
use gpuplane_node::dra::checkpoint::{self, CheckpointData, ClaimEntry, ClaimState};
use gpuplane_node::dra::core::{spec_stem, DraCore, DraCoreConfig};
use gpuplane_node::dra::fetch::ClaimFetcher;
use gpuplane_node::dra::{ClaimRef, ClaimUid, DeviceHealthState, DraDriver, PreparedDevice};
use gpuplane_node::node::state::{NodeState, Snapshot};
use gpuplane_node::paths::HostPaths;
use gpuplane_testkit::doubles::claims::MemoryClaims;
use gpuplane_testkit::doubles::devnodes;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const DRIVER: &str = "gpu.gpuplane.dev";
const NODE: &str = "node-a";
const KIND: &str = "k8s.gpu.gpuplane.dev/claim";

fn uid(n: u8) -> String {
    format!("0b5c3f2e-1111-4222-8333-4444555566{n:02x}")
}

struct Env {
    _dir: tempfile::TempDir,
    root: PathBuf,
    inv: Inventory,
    state: Arc<NodeState>,
    claims: Arc<MemoryClaims>,
    mode: DeviceMode,
}

impl Env {
    /// As on real hardware, with every device node in place; `None` (the test skips) where
    /// this process cannot make device nodes.
    fn new() -> Option<Env> {
        if !devnodes::can_make_nodes() {
            eprintln!("SKIPPED: making device nodes (mknod) needs root");
            return None;
        }
        let env = Env::bare(DeviceMode::Hardware);
        // Device nodes, and MIG access capabilities with their minors under a fake /proc.
        let dev = env.root.join("dev");
        devnodes::make_gpu_nodes(&dev, env.inv.gpus.iter().map(|g| g.minor)).unwrap();
        let mut minors = String::new();
        let mut next = 100;
        for g in &env.inv.gpus {
            for m in &g.mig_devices {
                for key in [
                    format!("gpu{}/gi{}/access", g.minor, m.gpu_instance_id),
                    format!(
                        "gpu{}/gi{}/ci{}/access",
                        g.minor, m.gpu_instance_id, m.compute_instance_id
                    ),
                ] {
                    minors.push_str(&format!("{key} {next}\n"));
                    devnodes::make_cap_node(&dev, next).unwrap();
                    next += 1;
                }
            }
        }
        let caps = env.root.join("proc/driver/nvidia-caps");
        fs::create_dir_all(&caps).unwrap();
        fs::write(caps.join("mig-minors"), minors).unwrap();
        Some(env)
    }

    /// No device nodes at all: what a simulated node (`gpuplane node --simulate`) has.
    fn simulated() -> Env {
        Env::bare(DeviceMode::Simulated)
    }

    fn bare(mode: DeviceMode) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let inv = gpuplane_model::sim::load("a100-mig-mixed").unwrap();
        fs::create_dir_all(root.join("driver")).unwrap();
        fs::create_dir_all(root.join("proc/sys/kernel/random")).unwrap();
        fs::write(root.join("proc/sys/kernel/random/boot_id"), "boot-1\n").unwrap();
        let snapshot = Snapshot::new(inv.clone(), AgentConfig::default()).unwrap();
        Env {
            _dir: dir,
            root,
            inv,
            state: Arc::new(NodeState::new(snapshot)),
            claims: Arc::new(MemoryClaims::default()),
            mode,
        }
    }

    fn config(&self) -> DraCoreConfig {
        DraCoreConfig {
            driver: DRIVER.into(),
            node_name: NODE.into(),
            paths: HostPaths::under(&self.root),
            device_mode: self.mode,
            mps: None,
            memory_limits: None,
        }
    }

    fn core(&self) -> DraCore {
        let fetcher: Arc<dyn ClaimFetcher> = self.claims.clone();
        let source = Arc::new(SimSource::new(self.inv.clone()));
        DraCore::new(self.config(), self.state.clone(), fetcher, source).unwrap()
    }

    fn cdi(&self) -> PathBuf {
        self.root.join("cdi")
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        let uid = ClaimUid::parse(uid).unwrap();
        self.cdi().join(format!("{}.json", spec_stem(&uid)))
    }

    fn spec(&self, uid: &str) -> Spec {
        serde_json::from_slice(&fs::read(self.spec_path(uid)).unwrap()).unwrap()
    }

    fn checkpoint_path(&self) -> PathBuf {
        self.root.join("state").join(checkpoint::FILE_NAME)
    }

    fn checkpoint(&self) -> CheckpointData {
        checkpoint::read(&self.root.join("state")).expect("a usable checkpoint slot")
    }

    fn mig(&self, i: usize) -> String {
        self.inv
            .dra_devices()
            .into_iter()
            .filter(|d| matches!(d, gpuplane_model::inventory::DeviceRef::Mig { .. }))
            .nth(i)
            .unwrap()
            .dra_name()
    }

    /// Adds an allocated claim `ns/<name>` with `results` (request, device) and `config`.
    fn add_claim(
        &self,
        name: &str,
        uid: &str,
        results: &[(&str, &str)],
        config: Value,
    ) -> ClaimRef {
        let results: Vec<Value> = results
            .iter()
            .map(|(r, d)| json!({"request": r, "driver": DRIVER, "pool": NODE, "device": d}))
            .collect();
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap();
        self.claims.insert(claim);
        cref(name, uid)
    }
}

fn cref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef::parse("ns", uid, name).unwrap()
}

fn mtimes(dir: &Path) -> BTreeMap<String, std::time::SystemTime> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().unwrap().modified().unwrap(),
            )
        })
        .collect()
}

fn devices(r: &Result<Vec<PreparedDevice>, String>) -> &[PreparedDevice] {
    r.as_ref().unwrap()
}

#[tokio::test]
async fn prepares_each_claim_on_its_own_idempotently_and_unprepares() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let mig = env.mig(0);
    let a = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let b = env.add_claim("b", &uid(2), &[("gpu", &mig)], json!([]));
    let bad = env.add_claim("bad", &uid(3), &[("gpu", "gpu-0")], json!([]));

    let first = core.prepare(vec![a.clone(), b.clone(), bad.clone()]).await;
    assert_eq!(first.len(), 3);
    let da = devices(&first[a.uid.as_str()]);
    assert_eq!(
        da,
        &[PreparedDevice {
            requests: vec!["gpu".into()],
            pool: NODE.into(),
            device: "gpu-3".into(),
            cdi_ids: vec![format!("{KIND}={}-gpu-3", a.uid)],
            share_id: None,
        }]
    );
    assert_eq!(
        devices(&first[b.uid.as_str()])[0].cdi_ids,
        vec![format!("{KIND}={}-{mig}", b.uid)]
    );
    let err = first[bad.uid.as_str()].as_ref().unwrap_err();
    assert!(
        err.contains("ns/bad") && err.contains("gpu-0") && err.contains(bad.uid.as_str()),
        "{err}"
    );

    // The specs: one per claim, our kind, the claim's device with its nodes.
    let spec = env.spec(&a.uid);
    assert_eq!(spec.kind, KIND);
    assert_eq!(
        spec.cdi_version, "0.5.0",
        "a name starting with a digit; podman 4.3 reads it"
    );
    assert_eq!(spec.devices.len(), 1);
    assert_eq!(spec.devices[0].name, format!("{}-gpu-3", a.uid));
    let gpu3 = env.inv.gpu(3).unwrap();
    let node_paths: Vec<&str> = spec.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(node_paths, vec![format!("/dev/nvidia{}", gpu3.minor)]);
    let mig_nodes = &env.spec(&b.uid).devices[0].container_edits.device_nodes;
    assert_eq!(
        mig_nodes.len(),
        3,
        "GPU node and the GI and CI access nodes: {mig_nodes:?}"
    );
    assert!(!env.spec_path(&bad.uid).exists());

    let cp = env.checkpoint();
    assert_eq!(cp.claims.len(), 2);
    assert_eq!(
        cp.claims[a.uid.as_str()].state,
        ClaimState::PrepareCompleted
    );
    assert_eq!(cp.claims[a.uid.as_str()].devices, da);
    let units = core.prepared_units().await;
    assert_eq!(units.get(gpu3.uuid.as_str()), Some(&a.uid.to_string()));
    assert_eq!(units.len(), 2);

    // Again: the same answer, nothing rewritten.
    let before = mtimes(&env.cdi());
    let cp_before = fs::read(env.checkpoint_path()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let second = core.prepare(vec![a.clone(), b.clone(), bad.clone()]).await;
    assert_eq!(second[a.uid.as_str()], first[a.uid.as_str()]);
    assert_eq!(second[b.uid.as_str()], first[b.uid.as_str()]);
    assert!(second[bad.uid.as_str()].is_err());
    assert_eq!(mtimes(&env.cdi()), before);
    assert_eq!(fs::read(env.checkpoint_path()).unwrap(), cp_before);

    // A new core (agent restart) answers the same from the checkpoint, without the API.
    env.claims.remove("ns", "a");
    let restarted = env.core();
    assert_eq!(
        restarted.prepare(vec![a.clone()]).await[a.uid.as_str()],
        first[a.uid.as_str()]
    );
    assert_eq!(mtimes(&env.cdi()), before);

    let out = restarted
        .unprepare(vec![a.clone(), b.clone(), cref("never", &uid(9))])
        .await;
    assert!(out.values().all(Result::is_ok), "{out:?}");
    assert!(!env.spec_path(&a.uid).exists() && !env.spec_path(&b.uid).exists());
    assert!(env.checkpoint().claims.is_empty());
    assert!(restarted.prepared_units().await.is_empty());
    assert_eq!(fs::read_dir(env.cdi()).unwrap().count(), 0);
    // Unpreparing again is fine. (A UID that is not one never reaches the core: the gRPC edge
    // answers its unprepare with success, tests/it/security.rs.)
    let out = restarted.unprepare(vec![a.clone()]).await;
    assert!(out.values().all(Result::is_ok), "{out:?}");
}

#[tokio::test]
async fn per_claim_errors_name_the_claim_and_the_reason() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let mut cases: Vec<(ClaimRef, &str)> = Vec::new();

    let wrong = env.add_claim("recreated", &uid(1), &[("gpu", "gpu-3")], json!([]));
    cases.push((cref("recreated", &uid(2)), "not 0b5c3f2e"));
    let _ = wrong;

    let c = env.add_claim("elsewhere", &uid(3), &[("gpu", "gpu-3")], json!([]));
    let mut claim = env.claims.get("ns", "elsewhere").await.unwrap();
    let results = claim
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap()
        .devices
        .as_mut()
        .unwrap();
    results.results.as_mut().unwrap()[0].pool = "node-b".into();
    env.claims.insert(claim);
    cases.push((c, "pool node-b"));

    cases.push((
        cref("missing", &uid(4)),
        "ResourceClaim ns/missing not found",
    ));

    let bad_config = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "Turbo"}}}}]);
    let c = env.add_claim("badconfig", &uid(5), &[("gpu", "gpu-3")], bad_config);
    cases.push((c, "sharing.strategy: `Turbo`"));

    // A UID or namespace that could reach a path never reaches the core: the gRPC edge parses
    // claims into ClaimRef, which refuses them (tests/it/security.rs sends them over the socket).
    let evil = ClaimRef::parse("ns", "../../x", "evil").unwrap_err();
    assert!(evil.to_string().contains("claim UID `../../x`"), "{evil}");
    let evil = ClaimRef::parse("a/b", uid(6), "x").unwrap_err();
    assert!(evil.to_string().contains("namespace `a/b`"), "{evil}");

    let mig = env.mig(1);
    let c = env.add_claim("sick", &uid(7), &[("gpu", &mig)], json!([]));
    let (parent_uuid, mig_uuid) = match env.inv.dra_device(&mig).unwrap() {
        DeviceRef::Mig { parent, mig } => (parent.uuid.clone(), mig.uuid.clone()),
        DeviceRef::Gpu(_) => unreachable!(),
    };
    let changes = core.health_changes();
    env.state.update(|s| {
        let policy = s.config.xid_policy.clone();
        s.health.on_event(
            &gpuplane_model::source::DeviceEvent::Xid {
                gpu_uuid: parent_uuid,
                mig_uuid: Some(mig_uuid.clone()),
                xid: 48,
            },
            Instant::now(),
            &policy,
        );
        ((), true)
    });
    assert!(changes.has_changed().unwrap());
    cases.push((c, "critical Xid 48"));

    let ok = env.add_claim("fine", &uid(8), &[("gpu", "gpu-3")], json!([]));
    let claims: Vec<ClaimRef> = cases
        .iter()
        .map(|(c, _)| c.clone())
        .chain([ok.clone()])
        .collect();
    let out = core.prepare(claims).await;
    for (c, want) in &cases {
        let err = out[c.uid.as_str()].as_ref().unwrap_err();
        assert!(
            err.contains(&format!("claim {}/{}", c.namespace, c.name)) && err.contains(want),
            "{err}\nwant {want}"
        );
    }
    assert!(out[ok.uid.as_str()].is_ok());
    assert_eq!(
        fs::read_dir(env.cdi()).unwrap().count(),
        1,
        "only the good claim has a spec"
    );
    assert_eq!(env.checkpoint().claims.len(), 1);

    let report = core.device_health();
    assert_eq!(report.len(), env.inv.dra_devices().len());
    let sick = report.iter().find(|r| r.device == mig).unwrap();
    assert_eq!(
        (sick.health, sick.message.as_str(), sick.pool.as_str()),
        (DeviceHealthState::Unhealthy, "critical Xid 48", NODE)
    );
    assert_eq!(
        report
            .iter()
            .filter(|r| r.health == DeviceHealthState::Healthy)
            .count(),
        report.len() - 1
    );
}

#[tokio::test]
async fn missing_device_nodes_fail_the_prepare_until_they_appear() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let node = env
        .root
        .join(format!("dev/nvidia{}", env.inv.gpu(3).unwrap().minor));
    fs::remove_file(&node).unwrap();
    let prepare_error = || async {
        core.prepare(vec![c.clone()])
            .await
            .remove(c.uid.as_str())
            .unwrap()
            .unwrap_err()
    };
    let err = prepare_error().await;
    assert!(
        err.contains(&format!("{} does not exist yet", node.display())),
        "{err}"
    );
    // Another claim's devices do not care.
    let mig = env.mig(0);
    let other = env.add_claim("b", &uid(2), &[("gpu", &mig)], json!([]));
    assert!(core.prepare(vec![other.clone()]).await[other.uid.as_str()].is_ok());
    // A regular file or another GPU's number in its place is no better.
    fs::write(&node, b"").unwrap();
    let err = prepare_error().await;
    assert!(
        err.contains(&format!(
            "{} is a regular file, not a character device",
            node.display()
        )),
        "{err}"
    );
    devnodes::make_node(&node, 195, 9).unwrap();
    let err = prepare_error().await;
    assert!(
        err.contains(&format!(
            "{} has device number 195:9, expected 195:3",
            node.display()
        )),
        "{err}"
    );
    assert!(!env.spec_path(&c.uid).exists(), "no spec names a bad node");
    devnodes::make_node(&node, 195, 3).unwrap();
    assert!(core.prepare(vec![c.clone()]).await[c.uid.as_str()].is_ok());
}

#[tokio::test]
async fn simulated_devices_are_prepared_without_device_nodes_and_carry_their_identity() {
    let env = Env::simulated();
    let core = env.core();
    let mig = env.mig(1);
    let c = env.add_claim(
        "a",
        &uid(1),
        &[("gpu", "gpu-3"), ("part", &mig)],
        json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing"}}}}]),
    );
    let prepared = core
        .prepare(vec![c.clone()])
        .await
        .remove(c.uid.as_str())
        .unwrap();
    assert_eq!(prepared.unwrap().len(), 2);
    let spec = env.spec(&c.uid);
    let gpu3 = env.inv.gpu(3).unwrap();
    let (parent, part) = env
        .inv
        .gpus
        .iter()
        .find_map(|g| {
            let i = g.mig_devices.iter().position(|m| {
                gpuplane_model::inventory::DeviceRef::Mig { parent: g, mig: m }.dra_name() == mig
            })?;
            Some((g, i))
        })
        .unwrap();
    let m = &parent.mig_devices[part];
    assert_eq!(
        spec.container_edits.env,
        vec![format!("NVIDIA_VISIBLE_DEVICES={},{}", gpu3.uuid, m.uuid)]
    );
    let env_of = |suffix: &str| {
        spec.devices
            .iter()
            .find(|d| d.name == format!("{}-{suffix}", c.uid))
            .unwrap()
            .container_edits
            .clone()
    };
    let whole = env_of("gpu-3");
    // The identity first, then the config's environment.
    assert_eq!(
        whole.env[0],
        format!("GPUPLANE_DEVICE_3=index=3,uuid={},profile=", gpu3.uuid)
    );
    assert!(
        whole.env[1..].contains(&"GPUPLANE_SHARING_STRATEGY=TimeSlicing".to_string()),
        "{:?}",
        whole.env
    );
    let sliced = env_of(&mig);
    assert_eq!(
        sliced.env,
        vec![format!(
            "GPUPLANE_DEVICE_{p}_MIG_{part}=index={p}:{part},uuid={},profile={}",
            m.uuid,
            m.profile,
            p = parent.index
        )]
    );
    for e in [&whole, &sliced, &spec.container_edits] {
        assert!(e.device_nodes.is_empty() && e.mounts.is_empty() && e.hooks.is_empty());
    }
    assert_eq!(spec.cdi_version, "0.5.0");
}

#[tokio::test]
async fn a_crash_between_started_and_completed_is_recovered() {
    let Some(env) = Env::new() else { return };
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let orphan = cref("gone", &uid(2));
    // What a crash of an agent before `cdiSpec` left: PrepareStarted entries and half-made
    // (here: stale) spec files.
    let mut data = CheckpointData::empty("boot-1");
    for r in [&c, &orphan] {
        data.claims.insert(
            r.uid.to_string(),
            ClaimEntry {
                namespace: r.namespace.to_string(),
                name: r.name.to_string(),
                state: ClaimState::PrepareStarted,
                devices: vec![],
                cdi_spec_stem: spec_stem(&r.uid),
                units: BTreeMap::new(),
                cdi_spec: None,
                shares: Vec::new(),
                instances: Vec::new(),
            },
        );
    }
    fs::create_dir_all(env.root.join("state")).unwrap();
    fs::write(env.checkpoint_path(), checkpoint::encode(&data).unwrap()).unwrap();
    fs::create_dir_all(env.cdi()).unwrap();
    for r in [&c, &orphan] {
        fs::write(env.spec_path(&r.uid), b"{\"stale\": true}").unwrap();
    }

    let core = env.core();
    assert_eq!(
        env.checkpoint().claims.len(),
        2,
        "kept until the kubelet retries"
    );
    let out = core.prepare(vec![c.clone()]).await;
    assert_eq!(devices(&out[c.uid.as_str()])[0].device, "gpu-3");
    assert_eq!(
        env.spec(&c.uid).devices.len(),
        1,
        "the stale spec was rewritten"
    );
    assert_eq!(
        env.checkpoint().claims[c.uid.as_str()].state,
        ClaimState::PrepareCompleted
    );

    // Preparing again changes nothing; unprepare then leaves nothing behind, for both.
    assert_eq!(
        core.prepare(vec![c.clone()]).await[c.uid.as_str()],
        out[c.uid.as_str()]
    );
    let out = core.unprepare(vec![c.clone(), orphan.clone()]).await;
    assert!(out.values().all(Result::is_ok), "{out:?}");
    assert_eq!(fs::read_dir(env.cdi()).unwrap().count(), 0);
    assert!(env.checkpoint().claims.is_empty());
}

#[tokio::test]
async fn specs_lost_or_left_empty_are_restored_from_the_checkpoint_at_start() {
    let Some(env) = Env::new() else { return };
    let a = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let b = env.add_claim("b", &uid(2), &[("gpu", &env.mig(0))], json!([]));
    let core = env.core();
    let first = core.prepare(vec![a.clone(), b.clone()]).await;
    assert!(first.values().all(Result::is_ok), "{first:?}");
    let (spec_a, spec_b) = (
        fs::read(env.spec_path(&a.uid)).unwrap(),
        fs::read(env.spec_path(&b.uid)).unwrap(),
    );
    drop(core);
    // The spec files are written without fsync: a power loss can leave one empty, or take it.
    fs::write(env.spec_path(&a.uid), b"").unwrap();
    fs::remove_file(env.spec_path(&b.uid)).unwrap();
    let core = env.core();
    assert_eq!(fs::read(env.spec_path(&a.uid)).unwrap(), spec_a);
    assert_eq!(fs::read(env.spec_path(&b.uid)).unwrap(), spec_b);
    let before = mtimes(&env.cdi());
    assert_eq!(core.prepare(vec![a.clone(), b.clone()]).await, first);
    assert_eq!(mtimes(&env.cdi()), before, "answered from the checkpoint");
}

#[tokio::test]
async fn a_spec_removed_behind_our_back_is_written_again() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let first = core.prepare(vec![c.clone()]).await;
    fs::remove_file(env.spec_path(&c.uid)).unwrap();
    assert_eq!(core.prepare(vec![c.clone()]).await, first);
    assert!(env.spec_path(&c.uid).exists());
}

#[tokio::test]
async fn a_corrupt_checkpoint_is_set_aside_and_the_core_starts_empty() {
    let Some(env) = Env::new() else { return };
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    env.core().prepare(vec![c.clone()]).await[c.uid.as_str()]
        .as_ref()
        .unwrap();
    let mut bytes = fs::read(env.checkpoint_path()).unwrap();
    let last = bytes.len() - 2;
    bytes[last] ^= 0x20;
    fs::write(env.checkpoint_path(), &bytes).unwrap();

    let core = env.core();
    assert!(core.checkpoint().await.claims.is_empty());
    let aside: Vec<String> = fs::read_dir(env.root.join("state"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("dra-checkpoint.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(
        fs::read(env.root.join("state").join(&aside[0])).unwrap(),
        bytes
    );
    assert!(
        env.checkpoint().claims.is_empty(),
        "a fresh, valid checkpoint replaced it"
    );
    // The claim's spec outlived its entry; unprepare still removes it.
    assert!(env.spec_path(&c.uid).exists());
    assert!(core.unprepare(vec![c.clone()]).await[c.uid.as_str()].is_ok());
    assert!(!env.spec_path(&c.uid).exists());
}

#[tokio::test]
async fn a_reboot_invalidates_prepared_claims_and_removes_their_specs() {
    let Some(env) = Env::new() else { return };
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    env.core().prepare(vec![c.clone()]).await[c.uid.as_str()]
        .as_ref()
        .unwrap();
    assert!(env.spec_path(&c.uid).exists());
    // A claim spec no entry names (an unsynced removal a power loss undid), and another file.
    let orphan = env.spec_path(&uid(9));
    fs::copy(env.spec_path(&c.uid), &orphan).unwrap();
    let other = env.cdi().join("vendor-spec.json");
    fs::write(&other, b"{}").unwrap();
    fs::write(env.root.join("proc/sys/kernel/random/boot_id"), "boot-2\n").unwrap();
    let core = env.core();
    assert!(!env.spec_path(&c.uid).exists());
    assert!(
        !orphan.exists(),
        "every claim spec of the earlier boot is swept"
    );
    assert!(other.exists(), "only claim specs");
    let cp = env.checkpoint();
    assert!(cp.claims.is_empty());
    assert_eq!(cp.boot_id, "boot-2");
    // The kubelet prepares it again after the reboot.
    assert!(core.prepare(vec![c.clone()]).await[c.uid.as_str()].is_ok());
    assert!(env.spec_path(&c.uid).exists());
}

/// A config becomes environment only where the node carries it out; an MPS config or a
/// time-slice interval it would not apply is refused at prepare, naming the field, with
/// nothing written and nothing held.
#[tokio::test]
async fn configs_become_container_environment_or_are_refused_naming_what_is_not_done() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let (mig, other) = (env.mig(2), env.mig(5));
    let gpu_config = |sharing: serde_json::Value| {
        json!({"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing}})
    };
    let config = json!([
        {"source": "FromClass", "opaque": gpu_config(json!({"strategy": "TimeSlicing"}))},
        {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"anything": true}}}
    ]);
    let c = env.add_claim(
        "a",
        &uid(1),
        &[("whole", "gpu-3"), ("shared", &mig)],
        config,
    );
    let out = core.prepare(vec![c.clone()]).await;
    assert_eq!(devices(&out[c.uid.as_str()]).len(), 2, "{out:?}");
    let spec = env.spec(&c.uid);
    for device in ["gpu-3", mig.as_str()] {
        let edits = &spec
            .devices
            .iter()
            .find(|d| d.name == format!("{}-{device}", c.uid))
            .unwrap()
            .container_edits;
        assert_eq!(edits.env, ["GPUPLANE_SHARING_STRATEGY=TimeSlicing"]);
    }
    assert!(spec
        .container_edits
        .env
        .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string()));

    let refused = [
        (
            json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}),
            "sharing.strategy: MPS is not supported",
        ),
        (
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            "sharing.timeSlicingConfig.interval: Long is not supported",
        ),
    ];
    for (i, (sharing, why)) in refused.into_iter().enumerate() {
        let c = env.add_claim(
            "a",
            &uid(2 + i as u8),
            &[("gpu", other.as_str())],
            json!([{"source": "FromClaim", "opaque": gpu_config(sharing)}]),
        );
        let err = core.prepare(vec![c.clone()]).await[c.uid.as_str()]
            .clone()
            .unwrap_err();
        assert!(err.contains(why), "{err}");
        assert!(
            !env.spec_path(&c.uid).exists(),
            "a refused claim has a spec"
        );
    }
    let free = env.add_claim("a", &uid(9), &[("gpu", other.as_str())], json!([]));
    assert!(
        core.prepare(vec![free.clone()]).await[free.uid.as_str()].is_ok(),
        "a refused claim left {other} held"
    );
}

#[tokio::test]
async fn concurrent_prepares_of_one_claim_agree() {
    let Some(env) = Env::new() else { return };
    let core = Arc::new(env.core());
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let (x, y) = tokio::join!(core.prepare(vec![c.clone()]), core.prepare(vec![c.clone()]));
    assert_eq!(x, y);
    assert!(x[c.uid.as_str()].is_ok());
    assert_eq!(
        env.checkpoint().claims[c.uid.as_str()].state,
        ClaimState::PrepareCompleted
    );
}

/// Host paths of every mount a spec makes (spec-wide and per device).
fn mounted(spec: &Spec) -> Vec<String> {
    spec.container_edits
        .mounts
        .iter()
        .chain(spec.devices.iter().flat_map(|d| &d.container_edits.mounts))
        .map(|m| m.host_path.clone())
        .collect()
}

/// The driver's libraries are scanned once per driver version, not per prepare: a library
/// installed after the first prepare is not in the second claim's spec (no scan saw it), and a
/// new driver version (an upgrade the inventory reports) scans again. Device nodes are still
/// checked on every prepare (see `missing_device_nodes_fail_the_prepare_until_they_appear`).
#[tokio::test]
async fn driver_libraries_are_scanned_once_per_driver_version() {
    let Some(env) = Env::new() else { return };
    let lib = env.root.join("driver/usr/lib64");
    fs::create_dir_all(&lib).unwrap();
    let version = env.inv.driver_version.clone();
    let cuda = lib.join(format!("libcuda.so.{version}"));
    let nvml = lib.join(format!("libnvidia-ml.so.{version}"));
    fs::write(&cuda, b"").unwrap();
    let core = env.core();
    let prepare = |name: &str, n: u8, device: String| {
        let c = env.add_claim(name, &uid(n), &[("gpu", &device)], json!([]));
        let core = &core;
        async move {
            let out = core.prepare(vec![c.clone()]).await;
            assert!(out[c.uid.as_str()].is_ok(), "{:?}", out[c.uid.as_str()]);
            c.uid
        }
    };
    let has =
        |uid: &str, file: &Path| mounted(&env.spec(uid)).contains(&file.display().to_string());

    let first = prepare("a", 1, env.mig(0)).await;
    assert!(has(&first, &cuda));
    fs::write(&nvml, b"").unwrap();
    let second = prepare("b", 2, env.mig(1)).await;
    assert!(has(&second, &cuda));
    assert!(!has(&second, &nvml), "the second prepare scanned again");
    assert_eq!(core.install_scans(), 1);

    let upgraded = "999.10.1";
    let new_cuda = lib.join(format!("libcuda.so.{upgraded}"));
    fs::write(&new_cuda, b"").unwrap();
    env.state.update(|s| {
        let mut inv = s.inventory.clone();
        inv.driver_version = upgraded.into();
        let config = s.config.clone();
        s.replace_inventory(inv, config).unwrap();
        ((), true)
    });
    let third = prepare("c", 3, env.mig(2)).await;
    assert!(has(&third, &new_cuda), "{:?}", mounted(&env.spec(&third)));
    assert!(
        has(&third, &nvml),
        "the new version's scan sees every library"
    );
    assert_eq!(core.install_scans(), 2);
}
