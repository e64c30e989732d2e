//! The NVML backend, black-box: hack/fake-nvml serves simulation profiles through NVML's C ABI,
//! `NvmlSource` loads it like the real `libnvidia-ml.so.1`, and what it reads must equal what
//! `gpuplane_model::sim::load` yields for the same profile.
//!
//! The fake keeps its machine in library statics chosen from environment variables at
//! `nvmlInit_v2`. So each test loads its own copy of the library (a different file is a separate
//! `dlopen`, with separate statics), and sets the variables and initialises under one lock.

mod support;

use gpuplane_model::inventory::DeviceUuid;
use gpuplane_model::sim;
use gpuplane_model::source::{
    ComputeMode, ComputeModeError, DeviceEvent, DeviceSource, MigChangeError, MigRequest, SimSource,
};
use gpuplane_node::nvml::NvmlSource;
use std::io::Write;
use std::path::{Path, PathBuf};

use std::sync::Mutex;
use std::time::Duration;

const PROFILE_ENV: &str = "GPUPLANE_FAKE_NVML_PROFILE";
const CONTROL_ENV: &str = "GPUPLANE_FAKE_NVML_CONTROL";
const STATE_ENV: &str = "GPUPLANE_FAKE_NVML_STATE";
const DRIVER_ENV: &str = "GPUPLANE_FAKE_NVML_DRIVER_VERSION";

/// Environment variables are process-wide: set them and initialise NVML under this lock.
static ENV: Mutex<()> = Mutex::new(());

/// A private copy of the fake library plus a control file, in a temporary directory.
struct Lab {
    dir: tempfile::TempDir,
    lib: PathBuf,
}

/// An `NvmlSource` over the fake, and the control file that steers it.
struct Machine {
    source: NvmlSource,
    control: PathBuf,
}

impl Lab {
    fn new() -> Lab {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libnvidia-ml.so.1");
        std::fs::copy(support::built_fake(), &lib).unwrap();
        Lab { dir, lib }
    }

    fn try_open(&self, profile: &str) -> Result<NvmlSource, gpuplane_model::source::SourceError> {
        self.try_open_with_state(profile, None)
    }

    /// Opens the fake serving `profile`, keeping its MIG instances in `state` if given.
    fn try_open_with_state(
        &self,
        profile: &str,
        state: Option<&Path>,
    ) -> Result<NvmlSource, gpuplane_model::source::SourceError> {
        let control = self.dir.path().join("control");
        std::fs::write(&control, "").unwrap();
        let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
        std::env::set_var(PROFILE_ENV, profile);
        std::env::set_var(CONTROL_ENV, &control);
        match state {
            Some(path) => std::env::set_var(STATE_ENV, path),
            None => std::env::remove_var(STATE_ENV),
        }
        std::env::remove_var(DRIVER_ENV);
        NvmlSource::open(Some(&self.lib))
    }

    /// Opens the fake serving `profile`. Drop the previous machine of this lab first.
    fn open(&self, profile: &str) -> Machine {
        self.open_with_state(profile, None)
    }

    fn open_with_state(&self, profile: &str, state: Option<&Path>) -> Machine {
        let source = self
            .try_open_with_state(profile, state)
            .unwrap_or_else(|e| panic!("{profile}: {e}"));
        Machine {
            source,
            control: self.dir.path().join("control"),
        }
    }
}

impl Machine {
    fn inject(&self, line: &str) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.control)
            .unwrap();
        writeln!(f, "{line}").unwrap();
    }

    fn next_event(&self) -> DeviceEvent {
        self.source
            .next_event(Duration::from_secs(10))
            .unwrap()
            .expect("an event within 10 s")
    }
}

#[test]
fn every_bundled_profile_reads_back_through_nvml_exactly_as_simulated() {
    let lab = Lab::new();
    for name in sim::bundled_names() {
        let machine = lab.open(name);
        let found = machine.source.discover().unwrap();
        assert!(found.lost.is_empty(), "{name}: {:?}", found.lost);
        assert_eq!(found.inventory, sim::load(name).unwrap(), "{name}");
    }
}

#[test]
fn an_injected_xid_reaches_next_event_with_the_gpus_uuid() {
    let lab = Lab::new();
    let machine = lab.open("dgx-h100");
    let expected = sim::load("dgx-h100").unwrap();
    let quiet = machine
        .source
        .next_event(Duration::from_millis(50))
        .unwrap();
    assert_eq!(quiet, None, "no event before one is injected");
    machine.inject("xid 3 48");
    let event = machine.next_event();
    assert_eq!(
        event,
        DeviceEvent::Xid {
            gpu_uuid: expected.gpus[3].uuid.clone(),
            mig_uuid: None,
            xid: 48
        }
    );
}

#[test]
fn an_xid_on_a_mig_instance_names_that_mig_device() {
    let lab = Lab::new();
    let machine = lab.open("a100-mig-mixed");
    let expected = sim::load("a100-mig-mixed").unwrap();
    let gpu = &expected.gpus[1];
    let mig = &gpu.mig_devices[1];
    machine.inject(&format!(
        "xid 1 31 {} {}",
        mig.gpu_instance_id, mig.compute_instance_id
    ));
    let event = machine.next_event();
    assert_eq!(
        event,
        DeviceEvent::Xid {
            gpu_uuid: gpu.uuid.clone(),
            mig_uuid: Some(mig.uuid.clone()),
            xid: 31
        }
    );
}

#[test]
fn a_gpu_that_falls_off_the_bus_is_reported_lost_while_the_others_are_still_served() {
    let lab = Lab::new();
    let machine = lab.open("dgx-h100");
    let expected = sim::load("dgx-h100").unwrap();
    let gpu2 = expected.gpus[2].uuid.clone();
    assert!(machine.source.responds(&gpu2));

    machine.inject("lose 2");
    assert_eq!(
        machine.next_event(),
        DeviceEvent::Xid {
            gpu_uuid: gpu2.clone(),
            mig_uuid: None,
            xid: 79
        }
    );
    assert!(!machine.source.responds(&gpu2));
    assert!(machine.source.responds(&expected.gpus[3].uuid));

    let found = machine.source.discover().unwrap();
    assert_eq!(found.lost.len(), 1, "{:?}", found.lost);
    assert_eq!(found.lost[0].index, 2);
    assert!(
        found.lost[0].reason.contains("lost"),
        "{}",
        found.lost[0].reason
    );
    assert_eq!(found.inventory.gpus.len(), 7);
    assert!(found
        .inventory
        .topology
        .links
        .iter()
        .all(|l| l.from != 2 && l.to != 2));
    // Exactly what the simulated twin reports for the same loss.
    let twin = SimSource::new(expected.clone());
    twin.set_lost(&gpu2, true);
    assert_eq!(found.inventory, twin.discover().unwrap().inventory);

    machine.inject("restore 2");
    assert!(machine.source.responds(&gpu2));
    let again = machine.source.discover().unwrap();
    assert!(again.lost.is_empty(), "{:?}", again.lost);
    assert_eq!(again.inventory, expected);
    // Registered for events again once back.
    machine.inject("xid 2 31");
    assert_eq!(
        machine.next_event(),
        DeviceEvent::Xid {
            gpu_uuid: gpu2,
            mig_uuid: None,
            xid: 31
        }
    );
}

#[test]
fn opening_a_missing_library_fails_with_one_sentence_pointing_at_simulate() {
    let err = NvmlSource::open(Some(Path::new("/nonexistent/libnvidia-ml.so.1"))).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("--simulate"), "{message}");
    assert!(message.contains("libnvidia-ml.so.1"), "{message}");
    assert!(
        message.contains("/nonexistent/libnvidia-ml.so.1"),
        "{message}"
    );
}

#[test]
fn a_fake_without_a_valid_profile_fails_to_initialise_instead_of_crashing() {
    let lab = Lab::new();
    let err = lab.try_open("no-such-profile").unwrap_err();
    assert!(err.to_string().contains("--simulate"), "{err}");
    // The library is still usable once given a good profile.
    let machine = lab.open("pcie-l4x4");
    assert_eq!(
        machine.source.discover().unwrap().inventory,
        sim::load("pcie-l4x4").unwrap()
    );
}

/// The dynamic-MIG machine: GPUs 0 and 1 H100s in MIG mode with no instances, GPU 2 an H100
/// with two static 3g.40gb, GPU 3 an L4.
const DYNAMIC: &str = "dynamic-mig-mixed";

fn mig_request(gpu: &DeviceUuid, profile: &str, start: u32) -> MigRequest {
    MigRequest {
        gpu: gpu.clone(),
        profile: profile.into(),
        start,
    }
}

/// The kind of a MIG change error, to compare two sources' answers.
fn kind(e: &MigChangeError) -> &'static str {
    match e {
        MigChangeError::Refused(_) => "Refused",
        MigChangeError::NotFound(_) => "NotFound",
        MigChangeError::Failed { .. } => "Failed",
    }
}

#[test]
fn dynamic_mig_through_nvml_creates_lists_refuses_and_destroys_as_simulated() {
    let lab = Lab::new();
    let machine = lab.open(DYNAMIC);
    let nvml = &machine.source;
    let sim = SimSource::new(sim::load(DYNAMIC).unwrap());
    let found = nvml.discover().unwrap().inventory;
    assert_eq!(found, sim.discover().unwrap().inventory);
    let tables: Vec<Option<&str>> = found.gpus.iter().map(|g| g.mig.table.as_deref()).collect();
    assert_eq!(
        tables,
        [
            Some("h100-80gb"),
            Some("h100-80gb"),
            Some("h100-80gb"),
            None
        ]
    );
    let gpu0 = found.gpus[0].uuid.clone();
    assert!(found.gpus[0].mig.current && found.gpus[0].mig_devices.is_empty());

    let both = |req: &MigRequest| (nvml.create_mig(req), sim.create_mig(req));
    let (four, four_sim) = both(&mig_request(&gpu0, "4g.40gb", 0));
    let four = four.unwrap();
    assert_eq!(
        four,
        four_sim.unwrap(),
        "NVML and the simulation create the same device"
    );
    let (three, three_sim) = both(&mig_request(&gpu0, "3g.40gb", 4));
    let three = three.unwrap();
    assert_eq!(three, three_sim.unwrap());
    assert_eq!((four.placement.start, three.placement.start), (0, 4));
    assert_ne!(four.uuid, three.uuid);
    let listed = nvml.discover().unwrap().inventory;
    assert_eq!(listed.gpus[0].mig_devices, [four.clone(), three.clone()]);
    assert_eq!(listed, sim.discover().unwrap().inventory);

    // Next to the 4g, a 3g at slice 0 overlaps it.
    let (overlap, overlap_sim) = both(&mig_request(&gpu0, "3g.40gb", 0));
    let overlap = overlap.unwrap_err();
    assert!(matches!(overlap, MigChangeError::Refused(_)), "{overlap}");
    assert!(overlap.to_string().contains(gpu0.as_str()), "{overlap}");
    assert_eq!(kind(&overlap_sim.unwrap_err()), "Refused");
    // One +me instance per GPU: the H100 has one OFA engine.
    let gpu1 = found.gpus[1].uuid.clone();
    let (me, me_sim) = both(&mig_request(&gpu1, "1g.10gb+me", 0));
    assert_eq!(me.unwrap(), me_sim.unwrap());
    let (second, second_sim) = both(&mig_request(&gpu1, "1g.10gb+me", 1));
    let second = second.unwrap_err();
    assert!(matches!(second, MigChangeError::Refused(_)), "{second}");
    assert!(
        second.to_string().contains("insufficient resources"),
        "{second}"
    );
    assert_eq!(kind(&second_sim.unwrap_err()), "Refused");
    // The L4 does no MIG.
    let (l4, l4_sim) = both(&mig_request(&found.gpus[3].uuid, "1g.10gb", 0));
    assert_eq!(kind(&l4.unwrap_err()), "Refused");
    assert_eq!(kind(&l4_sim.unwrap_err()), "Refused");

    nvml.destroy_mig(&gpu0, four.gpu_instance_id).unwrap();
    sim.destroy_mig(&gpu0, four.gpu_instance_id).unwrap();
    let after = nvml.discover().unwrap().inventory;
    assert_eq!(after.gpus[0].mig_devices, [three]);
    assert_eq!(after, sim.discover().unwrap().inventory);
    let again = nvml.destroy_mig(&gpu0, four.gpu_instance_id).unwrap_err();
    assert!(matches!(again, MigChangeError::NotFound(_)), "{again}");
    let again_sim = sim.destroy_mig(&gpu0, four.gpu_instance_id).unwrap_err();
    assert_eq!(kind(&again_sim), "NotFound");

    // A static instance destroyed and made again is a new device (a new UUID).
    let gpu2 = &found.gpus[2];
    let old = &gpu2.mig_devices[0];
    nvml.destroy_mig(&gpu2.uuid, old.gpu_instance_id).unwrap();
    sim.destroy_mig(&gpu2.uuid, old.gpu_instance_id).unwrap();
    let (new, new_sim) = both(&mig_request(&gpu2.uuid, "3g.40gb", 0));
    let new = new.unwrap();
    assert_eq!(new, new_sim.unwrap());
    assert_eq!(
        (new.gpu_instance_id, new.placement),
        (old.gpu_instance_id, old.placement)
    );
    assert_ne!(new.uuid, old.uuid);
    assert_eq!(
        nvml.discover().unwrap().inventory,
        sim.discover().unwrap().inventory
    );
}

/// A small deterministic generator (64-bit LCG), so the sequence is the same on every run.
struct Steps(u64);

impl Steps {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % below
    }
}

#[test]
fn the_simulation_and_the_fake_nvml_agree_on_every_create_and_destroy_of_a_long_sequence() {
    let lab = Lab::new();
    let machine = lab.open(DYNAMIC);
    let nvml = &machine.source;
    let sim = SimSource::new(sim::load(DYNAMIC).unwrap());
    let gpus = sim.discover().unwrap().inventory.gpus;
    let profiles = [
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
        "5g.50gb",
    ];
    let mut steps = Steps(7);
    let (mut created, mut refused, mut destroyed) = (0, 0, 0);
    for step in 0..300 {
        let gpu = &gpus[steps.next(gpus.len() as u64) as usize].uuid;
        let (answer, twin) = if steps.next(3) == 0 {
            let id = steps.next(8) as u32 + 1;
            let what = format!("destroy GI {id} on {gpu}");
            let pair = (nvml.destroy_mig(gpu, id), sim.destroy_mig(gpu, id));
            destroyed += usize::from(pair.0.is_ok());
            (
                pair.0.map(|()| None).map_err(|e| (what.clone(), e)),
                pair.1.map(|()| None),
            )
        } else {
            let req = mig_request(
                gpu,
                profiles[steps.next(profiles.len() as u64) as usize],
                steps.next(8) as u32,
            );
            let what = format!("create {req:?}");
            let pair = (nvml.create_mig(&req), sim.create_mig(&req));
            created += usize::from(pair.0.is_ok());
            (
                pair.0.map(Some).map_err(|e| (what.clone(), e)),
                pair.1.map(Some),
            )
        };
        match (answer, twin) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "step {step}"),
            (Err((what, a)), Err(b)) => {
                refused += 1;
                assert_eq!(kind(&a), kind(&b), "step {step}: {what}: NVML {a}; sim {b}");
            }
            (a, b) => panic!("step {step}: NVML {a:?}, simulation {b:?}"),
        }
        if step % 25 == 0 {
            assert_eq!(
                nvml.discover().unwrap().inventory,
                sim.discover().unwrap().inventory,
                "step {step}"
            );
        }
    }
    assert_eq!(
        nvml.discover().unwrap().inventory,
        sim.discover().unwrap().inventory
    );
    assert!(
        created > 20 && refused > 20 && destroyed > 10,
        "the sequence exercises all three: {created} created, {refused} refused, {destroyed} destroyed"
    );
}

#[test]
fn with_a_state_file_created_instances_outlive_the_process_that_made_them() {
    let lab = Lab::new();
    let state = lab.dir.path().join("mig-state.json");
    let machine = lab.open_with_state(DYNAMIC, Some(&state));
    let gpu = machine.source.discover().unwrap().inventory.gpus[1]
        .uuid
        .clone();
    let made = machine
        .source
        .create_mig(&mig_request(&gpu, "2g.20gb", 2))
        .unwrap();
    let before = machine.source.discover().unwrap().inventory;
    drop(machine);
    assert!(state.exists());

    // A fresh initialisation reads the file: the instance is still there, same UUID.
    let machine = lab.open_with_state(DYNAMIC, Some(&state));
    assert_eq!(machine.source.discover().unwrap().inventory, before);
    machine
        .source
        .destroy_mig(&gpu, made.gpu_instance_id)
        .unwrap();
    drop(machine);
    let machine = lab.open_with_state(DYNAMIC, Some(&state));
    assert_eq!(
        machine.source.discover().unwrap().inventory,
        sim::load(DYNAMIC).unwrap(),
        "destroyed, and remembered as destroyed"
    );
    machine
        .source
        .create_mig(&mig_request(&gpu, "2g.20gb", 2))
        .unwrap();
    drop(machine);

    // Without the file every initialisation starts from the profile.
    let machine = lab.open(DYNAMIC);
    assert_eq!(
        machine.source.discover().unwrap().inventory,
        sim::load(DYNAMIC).unwrap()
    );
}

#[test]
fn creating_on_a_gpu_with_mig_off_is_refused_by_nvml_and_the_simulation_alike() {
    let lab = Lab::new();
    let machine = lab.open("dgx-h100");
    let sim = SimSource::new(sim::load("dgx-h100").unwrap());
    let found = machine.source.discover().unwrap().inventory;
    let gpu = &found.gpus[0];
    assert!(gpu.mig.capable && !gpu.mig.current);
    assert_eq!(
        gpu.mig.table.as_deref(),
        Some("h100-80gb"),
        "known with MIG off too"
    );
    let req = mig_request(&gpu.uuid, "7g.80gb", 0);
    let nvml = machine.source.create_mig(&req).unwrap_err();
    assert!(matches!(nvml, MigChangeError::Refused(_)), "{nvml}");
    assert!(nvml.to_string().contains("MIG mode"), "{nvml}");
    assert_eq!(kind(&sim.create_mig(&req).unwrap_err()), "Refused");
    let destroy = machine.source.destroy_mig(&gpu.uuid, 1).unwrap_err();
    assert_eq!(
        kind(&destroy),
        kind(&sim.destroy_mig(&gpu.uuid, 1).unwrap_err())
    );
    assert_eq!(
        machine.source.discover().unwrap().inventory,
        found,
        "nothing changed"
    );
}

fn mode_kind(e: &ComputeModeError) -> &'static str {
    match e {
        ComputeModeError::Refused(_) => "Refused",
        ComputeModeError::NotFound(_) => "NotFound",
        ComputeModeError::Failed { .. } => "Failed",
    }
}

#[test]
fn a_compute_mode_set_through_nvml_reads_back_and_outlives_the_process_with_a_state_file() {
    let lab = Lab::new();
    let state = lab.dir.path().join("state.json");
    let machine = lab.open_with_state(DYNAMIC, Some(&state));
    let found = machine.source.discover().unwrap().inventory;
    let (gpu, other) = (&found.gpus[0].uuid, &found.gpus[3].uuid);
    let mode = |m: &Machine, uuid: &DeviceUuid| m.source.compute_mode(uuid).unwrap();
    assert_eq!(mode(&machine, gpu), ComputeMode::Default);
    machine
        .source
        .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)
        .unwrap();
    assert_eq!(mode(&machine, gpu), ComputeMode::ExclusiveProcess);
    assert_eq!(mode(&machine, other), ComputeMode::Default, "per GPU");

    // Refusals as the simulated source refuses: a MIG device, an unknown GPU.
    let sim = SimSource::new(sim::load(DYNAMIC).unwrap());
    let mig = &found.gpus[2].mig_devices[0].uuid;
    let nowhere = DeviceUuid::parse("GPU-00000000-0000-0000-0000-000000000000").unwrap();
    for (uuid, expected) in [(mig, "Refused"), (&nowhere, "NotFound")] {
        let nvml = machine
            .source
            .set_compute_mode(uuid, ComputeMode::ExclusiveProcess)
            .unwrap_err();
        assert_eq!(mode_kind(&nvml), expected, "{nvml}");
        let simulated = sim.compute_mode(uuid).unwrap_err();
        assert_eq!(mode_kind(&simulated), expected, "{simulated}");
    }
    drop(machine);

    // A fresh load of the same state: the mode is still set, as on a driver that stayed loaded.
    let machine = lab.open_with_state(DYNAMIC, Some(&state));
    assert_eq!(mode(&machine, gpu), ComputeMode::ExclusiveProcess);
    assert_eq!(mode(&machine, other), ComputeMode::Default);
    machine
        .source
        .set_compute_mode(gpu, ComputeMode::Default)
        .unwrap();
    machine.inject("lose 3");
    let lost = machine.source.compute_mode(other).unwrap_err();
    assert_eq!(mode_kind(&lost), "Failed", "{lost}");
    assert!(lost.to_string().contains("lost"), "{lost}");
    drop(machine);
    let machine = lab.open_with_state(DYNAMIC, Some(&state));
    assert_eq!(
        mode(&machine, gpu),
        ComputeMode::Default,
        "reset, and kept so"
    );
    machine
        .source
        .set_compute_mode(gpu, ComputeMode::Prohibited)
        .unwrap();
    drop(machine);

    // Without the file every load starts in DEFAULT, as after a driver reload.
    let machine = lab.open(DYNAMIC);
    assert_eq!(mode(&machine, gpu), ComputeMode::Default);
}

#[test]
fn per_cgroup_memory_limits_are_offered_only_by_a_driver_that_has_them() {
    let lab = Lab::new();
    let machine = lab.open("dgx-h100");
    assert_eq!(machine.source.memory_limit_library(), None, "driver 550");
    drop(machine);
    let r615 = {
        let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
        std::env::set_var(PROFILE_ENV, "dgx-h100");
        std::env::remove_var(STATE_ENV);
        std::env::set_var(DRIVER_ENV, "615.20.01");
        let opened = NvmlSource::open(Some(&lab.lib));
        std::env::remove_var(DRIVER_ENV);
        opened.unwrap()
    };
    assert_eq!(r615.memory_limit_library(), Some(lab.lib.clone()));
}
