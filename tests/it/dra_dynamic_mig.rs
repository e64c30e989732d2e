//! Dynamic MIG through the DRA core: a claim for a partitionable device gets its MIG instance
//! created (through the device source's mutation port) before its devices are planned, sees
//! that instance in its CDI spec, and the instance is destroyed when the claim is unprepared.
//! The checkpoint records intent and instance, so a restarted agent adopts what it made and
//! never touches an instance another tool made.

use gpuplane_model::config::AgentConfig;
use gpuplane_model::inventory::{Inventory, MigDevice};
use gpuplane_model::source::{DeviceMode, DeviceSource, MigRequest, SimSource};
use gpuplane_node::cdi::Spec;
use gpuplane_node::dra::checkpoint::{self, CheckpointData, ClaimState};
use gpuplane_node::dra::core::{spec_stem, DraCore, DraCoreConfig};
use gpuplane_node::dra::fetch::ClaimFetcher;
use gpuplane_node::dra::service::kubelet_error;
use gpuplane_node::dra::{ClaimRef, ClaimUid, DraDriver};
use gpuplane_node::node::dra::desired_slices;
use gpuplane_node::paths::HostPaths;
use gpuplane_node::state::{NodeState, Snapshot};
use gpuplane_testkit::doubles::claims::MemoryClaims;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use std::fs;
use std::path::PathBuf;
use std::sync::Arc;

const DRIVER: &str = "gpu.gpuplane.dev";
const NODE: &str = "node-a";
const PROFILE: &str = "dynamic-mig-mixed";
const CONFIG: &str = "dynamicMig:\n  gpus: [0, 1]\n";
const DEVICE_AT4: &str = "gpu-0-mig-3g40gb-at4";

fn uid(n: u8) -> String {
    format!("0b5c3f2e-1111-4222-8333-4444555566{n:02x}")
}

struct Env {
    dir: tempfile::TempDir,
    source: SimSource,
    claims: Arc<MemoryClaims>,
}

impl Env {
    fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("proc/sys/kernel/random")).unwrap();
        fs::write(root.join("proc/sys/kernel/random/boot_id"), "boot-1\n").unwrap();
        Env {
            dir,
            source: SimSource::new(gpuplane_model::sim::load(PROFILE).unwrap()),
            claims: Arc::new(MemoryClaims::default()),
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// What the hardware has now.
    fn hardware(&self) -> Inventory {
        self.source.discover().unwrap().inventory
    }

    fn instances(&self, gpu: usize) -> Vec<MigDevice> {
        self.hardware().gpus[gpu].mig_devices.clone()
    }

    /// A node state from what the hardware has now (an agent start).
    fn state(&self) -> Arc<NodeState> {
        let config = AgentConfig::parse("test", CONFIG).unwrap();
        Arc::new(NodeState::new(
            Snapshot::new(self.hardware(), config).unwrap(),
        ))
    }

    /// A core (an agent start) over this env's files and hardware.
    fn core(&self, state: Arc<NodeState>) -> DraCore {
        let root = self.dir.path();
        let config = DraCoreConfig {
            driver: DRIVER.into(),
            node_name: NODE.into(),
            paths: HostPaths::under(root),
            device_mode: DeviceMode::Simulated,
            mps: None,
            memory_limits: None,
        };
        let fetcher: Arc<dyn ClaimFetcher> = self.claims.clone();
        DraCore::new(config, state, fetcher, Arc::new(self.source.clone())).unwrap()
    }

    /// Claim `ns/<name>` allocated the devices `devices` of this node.
    fn add_claim(&self, name: &str, uid: &str, devices: &[&str]) -> ClaimRef {
        let results: Vec<_> = devices
            .iter()
            .map(|d| json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": d}))
            .collect();
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "mig.gpuplane.dev"}}]}},
            "status": {"allocation": {"devices": {"results": results}}}
        }))
        .unwrap();
        self.claims.insert(claim);
        ClaimRef::parse("ns", uid, name).unwrap()
    }

    /// The environment the claim's CDI spec gives its containers.
    fn spec_env(&self, uid: &str) -> String {
        let stem = spec_stem(&ClaimUid::parse(uid).unwrap());
        let spec: Spec =
            serde_json::from_slice(&fs::read(self.path(&format!("cdi/{stem}.json"))).unwrap())
                .unwrap();
        let mut env: Vec<String> = spec.container_edits.env.clone();
        env.extend(
            spec.devices
                .iter()
                .flat_map(|d| d.container_edits.env.clone()),
        );
        env.join("\n")
    }

    fn checkpoint(&self) -> CheckpointData {
        checkpoint::read(&self.path("state")).unwrap_or_else(|| CheckpointData::empty("none"))
    }
}

async fn prepare(core: &DraCore, c: &ClaimRef) -> Result<(), String> {
    // The error as the kubelet gets it, from the gRPC edge.
    let mut out = core.prepare(vec![c.clone()]).await;
    out.remove(&c.uid)
        .unwrap()
        .map(|_| ())
        .map_err(|e| kubelet_error(c, &e))
}

async fn unprepare(core: &DraCore, c: &ClaimRef) {
    let mut out = core.unprepare(vec![c.clone()]).await;
    out.remove(&c.uid).unwrap().unwrap();
}

fn placements(instances: &[MigDevice]) -> Vec<(String, u32)> {
    instances
        .iter()
        .map(|m| (m.profile.to_string(), m.placement.start))
        .collect()
}

#[tokio::test]
async fn a_claim_creates_its_instance_sees_it_and_unprepare_destroys_it() {
    let env = Env::new();
    assert!(
        env.instances(0).is_empty(),
        "the profile starts GPU 0 empty"
    );
    let core = env.core(env.state());
    let a = env.add_claim("a", &uid(1), &["gpu-0-mig-3g40gb-at4"]);
    prepare(&core, &a).await.unwrap();

    let made = env.instances(0);
    assert_eq!(placements(&made), [("3g.40gb".to_string(), 4)]);
    let uuid = made[0].uuid.to_string();
    assert!(
        env.spec_env(&a.uid).contains(&uuid),
        "the container sees the new instance {uuid}: {}",
        env.spec_env(&a.uid)
    );
    let entry = env.checkpoint().claims[a.uid.as_str()].clone();
    assert_eq!(entry.state, ClaimState::PrepareCompleted);
    assert_eq!(
        entry.instances[0]
            .created
            .as_ref()
            .map(|c| c.uuid.to_string()),
        Some(uuid.clone()),
        "the checkpoint records the instance it made"
    );
    // A repeated prepare (the kubelet's retry) creates nothing more.
    prepare(&core, &a).await.unwrap();
    assert_eq!(env.instances(0).len(), 1);

    unprepare(&core, &a).await;
    assert!(
        env.instances(0).is_empty(),
        "unprepare destroys the instance"
    );
    assert!(env.checkpoint().claims.is_empty());
    // Unprepare again (a retry) is fine with the instance gone.
    unprepare(&core, &a).await;
}

#[tokio::test]
async fn instances_that_fit_share_a_gpu_and_an_overlapping_one_is_refused_leaving_nothing() {
    let env = Env::new();
    let core = env.core(env.state());
    let big = env.add_claim("big", &uid(1), &["gpu-0-mig-4g40gb-at0"]);
    let small = env.add_claim("small", &uid(2), &["gpu-0-mig-3g40gb-at4"]);
    prepare(&core, &big).await.unwrap();
    prepare(&core, &small).await.unwrap();
    assert_eq!(
        placements(&env.instances(0)),
        [("4g.40gb".to_string(), 0), ("3g.40gb".to_string(), 4)]
    );

    // A stale allocation on memory slices the 4g instance covers: the hardware refuses it.
    let stale = env.add_claim("stale", &uid(3), &["gpu-0-mig-3g40gb-at0"]);
    let e = prepare(&core, &stale).await.unwrap_err();
    assert!(
        e.contains("gpu-0-mig-3g40gb-at0") && e.contains("overlaps"),
        "the error names the device and the rule: {e}"
    );
    assert_eq!(env.instances(0).len(), 2, "nothing was created");
    assert!(
        !env.checkpoint().claims.contains_key(stale.uid.as_str()),
        "no intent is left behind for a refused claim"
    );
    unprepare(&core, &big).await;
    unprepare(&core, &small).await;
    assert!(env.instances(0).is_empty());
}

#[tokio::test]
async fn a_whole_dynamic_gpu_is_prepared_as_its_full_instance() {
    let env = Env::new();
    let core = env.core(env.state());
    let whole = env.add_claim("whole", &uid(1), &["gpu-1"]);
    prepare(&core, &whole).await.unwrap();
    let made = env.instances(1);
    assert_eq!(placements(&made), [("7g.80gb".to_string(), 0)]);
    assert!(env.spec_env(&whole.uid).contains(made[0].uuid.as_str()));
    unprepare(&core, &whole).await;
    assert!(env.instances(1).is_empty());
}

#[tokio::test]
async fn a_restarted_agent_adopts_the_instance_it_created_before_recording_it() {
    let env = Env::new();
    let a = env.add_claim("a", &uid(1), &["gpu-0-mig-2g20gb-at2"]);
    {
        let core = env.core(env.state());
        prepare(&core, &a).await.unwrap();
    }
    // As if the agent had been killed between creating the instance and recording it: the
    // entry holds only the intent.
    let mut data = env.checkpoint();
    let entry = data.claims.get_mut(a.uid.as_str()).unwrap();
    entry.state = ClaimState::PrepareStarted;
    entry.cdi_spec = None;
    entry.devices.clear();
    for m in &mut entry.instances {
        m.created = None;
    }
    let mut cp = checkpoint::Checkpoint::load(&env.path("state"), Some("boot-1"))
        .unwrap()
        .checkpoint;
    cp.update(|d| d.claims = data.claims.clone()).unwrap();
    let before = env.instances(0);

    let core = env.core(env.state());
    prepare(&core, &a).await.unwrap();
    assert_eq!(
        env.instances(0),
        before,
        "the retry adopts the instance instead of making another"
    );
    let entry = env.checkpoint().claims[a.uid.as_str()].clone();
    assert_eq!(
        entry.instances[0].created.as_ref().map(|c| c.uuid.clone()),
        Some(before[0].uuid.clone())
    );
    unprepare(&core, &a).await;
    assert!(env.instances(0).is_empty());
}

#[tokio::test]
async fn an_instance_another_tool_made_is_never_touched_and_its_gpu_says_why() {
    let env = Env::new();
    // Made outside gpuplane, before the agent starts.
    let foreign = env
        .source
        .create_mig(&MigRequest {
            gpu: env.hardware().gpus[1].uuid.clone(),
            profile: "3g.40gb".into(),
            start: 0,
        })
        .unwrap();
    let state = env.state();
    let core = env.core(state.clone());
    {
        let snap = state.read();
        assert!(snap.inventory.gpus[0].mig.dynamic);
        assert!(
            !snap.inventory.gpus[1].mig.dynamic,
            "a GPU with instances gpuplane did not make does not take part"
        );
        let names: Vec<String> = desired_slices(&snap, DRIVER, NODE)
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
            .collect();
        assert!(
            names.iter().any(|n| n == "gpu-0-mig-3g40gb-at4"),
            "{names:?}"
        );
        assert!(
            !names.iter().any(|n| n.starts_with("gpu-1-mig-") && n.contains("-at")),
            "GPU 1 publishes its existing instance as a static MIG device, no placements: {names:?}"
        );
        assert!(
            snap.plan
                .resources
                .iter()
                .flat_map(|r| &r.devices)
                .all(|d| d.gpu_index != 0),
            "the device plugin never offers a dynamic GPU"
        );
    }
    let a = env.add_claim("a", &uid(1), &["gpu-0-mig-1g10gb-at6"]);
    prepare(&core, &a).await.unwrap();
    unprepare(&core, &a).await;
    assert_eq!(
        env.instances(1),
        [foreign],
        "the other tool's instance is still there"
    );
}

#[tokio::test]
async fn an_xid_on_the_instance_or_its_parent_reaches_the_claims_device() {
    use gpuplane_model::source::DeviceEvent;
    use gpuplane_node::dra::DeviceHealthState;
    let env = Env::new();
    let state = env.state();
    let core = env.core(state.clone());
    let health_of = |core: &DraCore, name: &str| {
        core.device_health()
            .into_iter()
            .find(|r| r.device == name)
            .map(|r| r.health)
    };
    assert_eq!(
        health_of(&core, DEVICE_AT4),
        Some(DeviceHealthState::Healthy),
        "a placement not yet prepared reports its GPU's health"
    );
    let a = env.add_claim("a", &uid(1), &[DEVICE_AT4]);
    prepare(&core, &a).await.unwrap();
    let (gpu, mig) = {
        let hw = env.hardware();
        (
            hw.gpus[0].uuid.clone(),
            hw.gpus[0].mig_devices[0].uuid.clone(),
        )
    };
    let xid = |mig: Option<&gpuplane_model::inventory::DeviceUuid>| {
        let event = DeviceEvent::Xid {
            gpu_uuid: gpu.clone(),
            mig_uuid: mig.cloned(),
            xid: 48,
        };
        state.update(|s| {
            let policy = s.config.xid_policy.clone();
            s.health
                .on_event(&event, std::time::Instant::now(), &policy);
            ((), true)
        });
    };
    xid(Some(&mig));
    assert_eq!(
        health_of(&core, DEVICE_AT4),
        Some(DeviceHealthState::Unhealthy),
        "an Xid on the instance"
    );
    assert_eq!(
        health_of(&core, "gpu-0-mig-4g40gb-at0"),
        Some(DeviceHealthState::Healthy),
        "only that instance"
    );
    xid(None);
    assert_eq!(
        health_of(&core, "gpu-0-mig-4g40gb-at0"),
        Some(DeviceHealthState::Unhealthy),
        "an Xid on the parent reaches every device of the GPU"
    );
    unprepare(&core, &a).await;
}

/// A `--simulate` node keeps its MIG instances and compute modes across agent restarts of one
/// boot, as a driver does: the next agent's simulated machine has the instance a claim made
/// (else it would drop the claim's instance as gone), and after a reboot the profile's state.
#[test]
fn a_simulated_machine_keeps_its_instances_across_agent_restarts_of_one_boot() {
    use gpuplane_model::source::ComputeMode;
    use gpuplane_node::node::kept_sim::KeptSim;
    let dir = tempfile::tempdir().unwrap();
    let machine = || SimSource::new(gpuplane_model::sim::load("dynamic-mig-mixed").unwrap());
    let boot = |id: &str| Some(id.to_string());
    let first = KeptSim::open(machine(), dir.path(), boot("boot-1"));
    let gpu = first.discover().unwrap().inventory.gpus[0].uuid.clone();
    let made = first
        .create_mig(&MigRequest {
            gpu: gpu.clone(),
            profile: "3g.40gb".into(),
            start: 0,
        })
        .unwrap();
    first
        .set_compute_mode(&gpu, ComputeMode::ExclusiveProcess)
        .unwrap();
    drop(first);

    let migs = |s: &KeptSim| -> Vec<MigDevice> {
        s.discover().unwrap().inventory.gpus[0].mig_devices.clone()
    };
    let again = KeptSim::open(machine(), dir.path(), boot("boot-1"));
    assert_eq!(migs(&again), vec![made.clone()]);
    assert_eq!(
        again.compute_mode(&gpu).unwrap(),
        ComputeMode::ExclusiveProcess
    );
    // Its instance is destroyed through the next agent, and that is kept too.
    again.destroy_mig(&gpu, made.gpu_instance_id).unwrap();
    drop(again);
    assert!(migs(&KeptSim::open(machine(), dir.path(), boot("boot-1"))).is_empty());

    // A reboot: the profile's state, whatever was saved.
    let kept = KeptSim::open(machine(), dir.path(), boot("boot-1"));
    kept.create_mig(&MigRequest {
        gpu: gpu.clone(),
        profile: "3g.40gb".into(),
        start: 0,
    })
    .unwrap();
    drop(kept);
    let rebooted = KeptSim::open(machine(), dir.path(), boot("boot-2"));
    assert!(migs(&rebooted).is_empty());
    assert_eq!(rebooted.compute_mode(&gpu).unwrap(), ComputeMode::Default);
}
