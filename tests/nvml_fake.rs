//! The NVML backend, black-box: hack/fake-nvml serves simulation profiles through NVML's C ABI,
//! `NvmlSource` loads it like the real `libnvidia-ml.so.1`, and what it reads must equal what
//! `gpuplane_shell::sim::load` yields for the same profile.
//!
//! The fake keeps its machine in library statics chosen from environment variables at
//! `nvmlInit_v2`. So each test loads its own copy of the library (a different file is a separate
//! `dlopen`, with separate statics), and sets the variables and initialises under one lock.

mod support;

use gpuplane_shell::nvml::NvmlSource;
use gpuplane_shell::sim;
use gpuplane_shell::source::{DeviceEvent, DeviceSource, SimSource};
use std::io::Write;
use std::path::{Path, PathBuf};

use std::sync::Mutex;
use std::time::Duration;

const PROFILE_ENV: &str = "GPUPLANE_FAKE_NVML_PROFILE";
const CONTROL_ENV: &str = "GPUPLANE_FAKE_NVML_CONTROL";

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

    fn try_open(&self, profile: &str) -> Result<NvmlSource, gpuplane_shell::source::SourceError> {
        let control = self.dir.path().join("control");
        std::fs::write(&control, "").unwrap();
        let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
        std::env::set_var(PROFILE_ENV, profile);
        std::env::set_var(CONTROL_ENV, &control);
        NvmlSource::open(Some(&self.lib))
    }

    /// Opens the fake serving `profile`. Drop the previous machine of this lab first.
    fn open(&self, profile: &str) -> Machine {
        let source = self
            .try_open(profile)
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
