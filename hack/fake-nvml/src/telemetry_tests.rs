//! The telemetry exports called in process: readings from the telemetry file and its changes,
//! process listings (MPS, MIG), MIG refusals, `fail`, lost GPUs, and a stalled device that holds
//! up no other device's calls. Each test holds the machine lock `tests.rs` keeps.

use crate::telemetry::*;
use crate::tests::{gpu, machine, ok};
use crate::*;
use std::ffi::{c_uint, CString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tempfile::TempDir;

const GIB: u64 = 1 << 30;
const A100_BYTES: u64 = 40960 << 20;
const DOUBLE_BIT: u32 =
    nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR;
const SINGLE_BIT: u32 =
    nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS;

/// A test's directory with the telemetry file (not written yet) and the control file.
struct Files {
    _dir: TempDir,
    telemetry: PathBuf,
    control: PathBuf,
}

/// Builds the machine of `profile` reading telemetry and control files in a new directory.
fn open(profile: &str) -> Files {
    let dir = tempfile::tempdir().unwrap();
    let files = Files {
        telemetry: dir.path().join("telemetry.json"),
        control: dir.path().join("control"),
        _dir: dir,
    };
    std::env::set_var(state::PROFILE_ENV, profile);
    std::env::set_var(state::CONTROL_ENV, &files.control);
    std::env::set_var(TELEMETRY_ENV, &files.telemetry);
    std::env::remove_var(state::STATE_ENV);
    std::env::remove_var(system::DRIVER_VERSION_ENV);
    ok(nvmlInit_v2());
    files
}

fn close() {
    ok(nvmlShutdown());
    std::env::remove_var(TELEMETRY_ENV);
    std::env::remove_var(state::CONTROL_ENV);
}

/// Replaces the file whole, as writers are told to.
fn write(path: &Path, json: &str) {
    let fresh = path.with_extension("tmp");
    std::fs::write(&fresh, json).unwrap();
    std::fs::rename(&fresh, path).unwrap();
}

fn control(files: &Files, line: &str) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&files.control)
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

/// GPU `index`'s UUID and its MIG devices' `(uuid, gi, ci)`.
fn uuids(index: usize) -> (String, Vec<(String, u32, u32)>) {
    state::with_fake(|f| {
        let g = &f.inventory.gpus[index];
        let migs = g.mig_devices.iter();
        let migs = migs.map(|m| {
            let ids = (m.gpu_instance_id, m.compute_instance_id);
            (m.uuid.to_string(), ids.0, ids.1)
        });
        Ok((g.uuid.to_string(), migs.collect()))
    })
    .unwrap()
}

fn by_uuid(uuid: &str) -> nvmlDevice_t {
    let text = CString::new(uuid).unwrap();
    let mut device = null_mut();
    // SAFETY: NUL-terminated string and live out-pointer.
    ok(unsafe { device::nvmlDeviceGetHandleByUUID(text.as_ptr(), &mut device) });
    device
}

fn temperature(d: nvmlDevice_t) -> (Ret, u32) {
    let mut t = 0;
    // SAFETY: live out-pointer.
    let code = unsafe { nvmlDeviceGetTemperature(d, 0, &mut t) };
    (code, t)
}

fn utilization(d: nvmlDevice_t) -> (Ret, (u32, u32)) {
    let mut u = nvmlUtilization_t { gpu: 0, memory: 0 };
    // SAFETY: live out-pointer.
    let code = unsafe { nvmlDeviceGetUtilizationRates(d, &mut u) };
    (code, (u.gpu, u.memory))
}

/// `nvmlDeviceGetMemoryInfo_v2`'s `(total, used, free)`, checked against the first version's.
fn memory(d: nvmlDevice_t) -> (Ret, (u64, u64, u64)) {
    let version = (std::mem::size_of::<nvmlMemory_v2_t>() | 2 << 24) as c_uint;
    let mut m = nvmlMemory_v2_t {
        version,
        total: 0,
        reserved: 0,
        free: 0,
        used: 0,
    };
    let mut old = nvmlMemory_t {
        total: 0,
        free: 0,
        used: 0,
    };
    // SAFETY: live out-pointers.
    let (code, old_code) = unsafe {
        (
            device::nvmlDeviceGetMemoryInfo_v2(d, &mut m),
            device::nvmlDeviceGetMemoryInfo(d, &mut old),
        )
    };
    assert_eq!(old_code, code);
    assert_eq!((old.total, old.used, old.free), (m.total, m.used, m.free));
    (code, (m.total, m.used, m.free))
}

type Lister = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> Ret;

/// A process listing read as nvml-wrapper reads it: count with an empty buffer, then fill one
/// with headroom. `(pid, memory, gi, ci)`.
fn listing(list: Lister, d: nvmlDevice_t) -> Result<Vec<(u32, u64, u32, u32)>, Ret> {
    let mut count = 0;
    // SAFETY: a null buffer of capacity 0; live out-pointer.
    match unsafe { list(d, &mut count, null_mut()) } {
        SUCCESS => {
            assert_eq!(count, 0, "SUCCESS only when there is none");
            return Ok(Vec::new());
        }
        INSUFFICIENT_SIZE => assert!(count > 0),
        other => return Err(other),
    }
    let blank = nvmlProcessInfo_t {
        pid: 0,
        usedGpuMemory: 0,
        gpuInstanceId: 0,
        computeInstanceId: 0,
    };
    let mut buf = vec![blank; count as usize + 5];
    count += 5;
    // SAFETY: `count` is the buffer's length.
    ok(unsafe { list(d, &mut count, buf.as_mut_ptr()) });
    buf.truncate(count as usize);
    let tuple = |p: &nvmlProcessInfo_t| {
        let ids = (p.gpuInstanceId, p.computeInstanceId);
        (p.pid, p.usedGpuMemory, ids.0, ids.1)
    };
    Ok(buf.iter().map(tuple).collect())
}

fn compute(d: nvmlDevice_t) -> Result<Vec<(u32, u64, u32, u32)>, Ret> {
    listing(nvmlDeviceGetComputeRunningProcesses_v3, d)
}

fn mps(d: nvmlDevice_t) -> Result<Vec<(u32, u64, u32, u32)>, Ret> {
    listing(nvmlDeviceGetMPSComputeRunningProcesses_v3, d)
}

/// `nvmlDeviceGetProcessUtilization` since `last_seen`: `(pid, smUtil)`.
fn process_utilization(d: nvmlDevice_t, last_seen: u64) -> Result<Vec<(u32, u32)>, Ret> {
    let mut count = 0;
    // SAFETY: a null buffer asks for the count; live out-pointer.
    match unsafe { nvmlDeviceGetProcessUtilization(d, null_mut(), &mut count, last_seen) } {
        INSUFFICIENT_SIZE => {}
        other => return Err(other),
    }
    let blank = nvmlProcessUtilizationSample_t {
        pid: 0,
        timeStamp: 0,
        smUtil: 0,
        memUtil: 9,
        encUtil: 9,
        decUtil: 9,
    };
    let mut buf = vec![blank; count as usize];
    // SAFETY: `count` is the buffer's length.
    ok(unsafe { nvmlDeviceGetProcessUtilization(d, buf.as_mut_ptr(), &mut count, last_seen) });
    assert!(buf.iter().all(|s| s.timeStamp > last_seen));
    assert!(buf
        .iter()
        .all(|s| (s.memUtil, s.encUtil, s.decUtil) == (0, 0, 0)));
    Ok(buf.iter().map(|s| (s.pid, s.smUtil)).collect())
}

/// Double-bit retired pages as nvml-wrapper reads them: counted with the first version, read
/// with `_v2`. `(addresses, timestamps)`.
fn retired_pages(d: nvmlDevice_t) -> (Vec<u64>, Vec<u64>) {
    let (mut count, mut scratch) = (0, 0);
    // SAFETY: a buffer of capacity 0 (non-null, as nvml-wrapper passes it); live count.
    let code = unsafe { nvmlDeviceGetRetiredPages(d, DOUBLE_BIT, &mut count, &mut scratch) };
    assert!(
        code == INSUFFICIENT_SIZE || (code == SUCCESS && count == 0),
        "{code}"
    );
    let (mut addresses, mut times) = (vec![0; count as usize], vec![0; count as usize]);
    // SAFETY: both buffers hold `count` entries.
    ok(unsafe {
        nvmlDeviceGetRetiredPages_v2(
            d,
            DOUBLE_BIT,
            &mut count,
            addresses.as_mut_ptr(),
            times.as_mut_ptr(),
        )
    });
    (addresses, times)
}

/// Every whole-GPU scalar reading with its code: temperature, power, power limit, throttle
/// reasons, corrected and uncorrected (volatile) ECC errors, PCIe replays.
fn scalars(d: nvmlDevice_t) -> Vec<(Ret, u64)> {
    type U32Reading = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> Ret;
    let small = |read: U32Reading| {
        let mut v = 0;
        // SAFETY: live out-pointer.
        let code = unsafe { read(d, &mut v) };
        (code, u64::from(v))
    };
    let ecc = |error_type| {
        let mut v = 0;
        // SAFETY: live out-pointer.
        let code = unsafe { nvmlDeviceGetTotalEccErrors(d, error_type, 0, &mut v) };
        (code, v)
    };
    let mut reasons = 0;
    // SAFETY: live out-pointer.
    let throttle = unsafe { nvmlDeviceGetCurrentClocksThrottleReasons(d, &mut reasons) };
    let (code, temp) = temperature(d);
    vec![
        (code, u64::from(temp)),
        small(nvmlDeviceGetPowerUsage),
        small(nvmlDeviceGetEnforcedPowerLimit),
        (throttle, reasons),
        ecc(0),
        ecc(1),
        small(nvmlDeviceGetPcieReplayCounter),
    ]
}

fn codes(readings: &[(Ret, u64)]) -> Vec<Ret> {
    readings.iter().map(|r| r.0).collect()
}

#[test]
fn readings_follow_the_telemetry_file_as_it_changes() {
    let _machine = machine();
    let files = open("a100-mig-mixed");
    let plain = gpu(3);
    let (uuid, _) = uuids(3);
    let defaults = [35, 70_000, 700_000, 0x1, 0, 0, 0];
    let default_readings: Vec<(Ret, u64)> = defaults.iter().map(|v| (SUCCESS, *v)).collect();
    assert_eq!(scalars(plain), default_readings, "no file yet: defaults");
    assert_eq!(memory(plain), (SUCCESS, (A100_BYTES, 0, A100_BYTES)));
    assert_eq!(utilization(plain), (SUCCESS, (0, 0)));
    assert_eq!(compute(plain), Ok(vec![]));
    assert_eq!(process_utilization(plain, 0), Err(NOT_FOUND));

    write(
        &files.telemetry,
        &format!(
            r#"{{"devices": {{"{uuid}": {{"gpuUtil": 40, "memoryUtil": 20, "temperatureC": 71,
            "powerMilliwatts": 250000, "powerLimitMilliwatts": 400000, "throttleReasons": 4,
            "eccCorrected": 3, "eccUncorrected": 1, "retiredPages": 2, "pcieReplays": 5,
            "processes": [{{"pid": 100, "memoryBytes": {GIB}, "smUtil": 30}},
                          {{"pid": 101, "memoryBytes": {}}}]}}}}}}"#,
            2 * GIB
        ),
    );
    let expected = [71, 250_000, 400_000, 4, 3, 1, 5];
    let expected: Vec<(Ret, u64)> = expected.iter().map(|v| (SUCCESS, *v)).collect();
    assert_eq!(scalars(plain), expected);
    let mut aggregate = 0;
    // SAFETY: live out-pointer.
    ok(unsafe { nvmlDeviceGetTotalEccErrors(plain, 0, 1, &mut aggregate) });
    assert_eq!(aggregate, 3, "the aggregate count is the volatile one");
    assert_eq!(
        memory(plain),
        (SUCCESS, (A100_BYTES, 3 * GIB, A100_BYTES - 3 * GIB))
    );
    assert_eq!(utilization(plain), (SUCCESS, (40, 20)));
    let none = state::NO_INSTANCE;
    assert_eq!(
        compute(plain),
        Ok(vec![(100, GIB, none, none), (101, 2 * GIB, none, none)])
    );
    assert_eq!(mps(plain), Ok(vec![]));
    assert_eq!(process_utilization(plain, 0), Ok(vec![(100, 30)]));
    assert_eq!(
        process_utilization(plain, u64::MAX),
        Err(NOT_FOUND),
        "nothing newer than the last seen sample"
    );
    let (addresses, times) = retired_pages(plain);
    assert_eq!((addresses.len(), times.len()), (2, 2));
    assert!(addresses[0] != addresses[1] && times.iter().all(|t| *t > 0));
    let mut count = 4;
    // SAFETY: no buffer is written when there is nothing to list.
    let code = unsafe {
        nvmlDeviceGetRetiredPages_v2(plain, SINGLE_BIT, &mut count, null_mut(), null_mut())
    };
    assert_eq!((code, count), (SUCCESS, 0), "single-bit: none");
    let mut short = 1;
    let mut one = [0u64; 1];
    // SAFETY: `short` is the buffer's length.
    let code = unsafe {
        nvmlDeviceGetRetiredPages_v2(plain, DOUBLE_BIT, &mut short, one.as_mut_ptr(), null_mut())
    };
    assert_eq!((code, short), (INSUFFICIENT_SIZE, 2));
    let mut t = 0;
    // SAFETY: live out-pointer.
    let other_sensor = unsafe { nvmlDeviceGetTemperature(plain, 1, &mut t) };
    assert_eq!(other_sensor, INVALID_ARGUMENT);

    // Rewritten: the new readings; memory in use past the total is capped.
    write(
        &files.telemetry,
        &format!(
            r#"{{"devices": {{"{uuid}": {{"gpuUtil": 90, "memoryUsedBytes": {}}}}}}}"#,
            64 * GIB
        ),
    );
    assert_eq!(utilization(plain), (SUCCESS, (90, 0)));
    assert_eq!(memory(plain), (SUCCESS, (A100_BYTES, A100_BYTES, 0)));
    assert_eq!(compute(plain), Ok(vec![]));

    // A bad file keeps the last good content; a missing one means defaults.
    write(&files.telemetry, r#"{"devices": {"#);
    assert_eq!(utilization(plain), (SUCCESS, (90, 0)));
    write(&files.telemetry, r#"{"devices": {}, "bogus": 1}"#);
    assert_eq!(utilization(plain), (SUCCESS, (90, 0)));
    std::fs::remove_file(&files.telemetry).unwrap();
    assert_eq!(utilization(plain), (SUCCESS, (0, 0)));
    assert_eq!(scalars(plain), default_readings);
    close();
}

#[test]
fn mps_clients_and_mig_devices_list_their_processes_and_mig_refuses_whole_gpu_facts() {
    let _machine = machine();
    let files = open("a100-mig-mixed");
    let (plain_uuid, _) = uuids(3);
    let (_, migs) = uuids(0);
    let ((first, gi0, ci0), (second, gi1, ci1)) = (migs[0].clone(), migs[1].clone());
    write(
        &files.telemetry,
        &format!(
            r#"{{"devices": {{
            "{plain_uuid}": {{"mpsServerPid": 50, "processes": [
                {{"pid": 51, "memoryBytes": 10, "mps": true, "smUtil": 20}},
                {{"pid": 52, "memoryBytes": 5, "mps": true}},
                {{"pid": 60, "memoryBytes": 7}}]}},
            "{first}": {{"gpuUtil": 50, "memoryUsedBytes": 1024,
                "processes": [{{"pid": 70, "memoryBytes": 100, "smUtil": 10}}]}},
            "{second}": {{"processes": [{{"pid": 80, "memoryBytes": 200}}]}}}}}}"#
        ),
    );
    let plain = gpu(3);
    let none = state::NO_INSTANCE;
    assert_eq!(
        compute(plain),
        Ok(vec![(60, 7, none, none), (50, 15, none, none)]),
        "the MPS server stands for its clients"
    );
    assert_eq!(
        mps(plain),
        Ok(vec![(51, 10, none, none), (52, 5, none, none)])
    );
    assert_eq!(memory(plain).1 .1, 22);
    assert_eq!(process_utilization(plain, 0), Ok(vec![(51, 20)]));

    let (mig, whole) = (by_uuid(&first), gpu(0));
    assert_eq!(compute(mig), Ok(vec![(70, 100, gi0, ci0)]));
    assert_eq!(mps(mig), Ok(vec![]));
    assert_eq!(
        compute(whole),
        Ok(vec![(70, 100, gi0, ci0), (80, 200, gi1, ci1)]),
        "a GPU in MIG mode lists its MIG devices' processes"
    );
    assert_eq!(memory(mig).1 .1, 1024, "memory is per MIG device");
    assert_eq!(utilization(mig).0, NOT_SUPPORTED);
    assert_eq!(
        utilization(whole).0,
        NOT_SUPPORTED,
        "no counters in MIG mode"
    );
    assert_eq!(process_utilization(mig, 0), Err(NOT_SUPPORTED));
    assert_eq!(process_utilization(whole, 0), Err(NOT_SUPPORTED));
    assert!(codes(&scalars(mig)).iter().all(|c| *c == NOT_SUPPORTED));
    let mut count = 0;
    // SAFETY: live count; no buffer is written on a refusal.
    let code = unsafe {
        nvmlDeviceGetRetiredPages_v2(mig, DOUBLE_BIT, &mut count, null_mut(), null_mut())
    };
    assert_eq!(code, NOT_SUPPORTED);
    assert!(
        codes(&scalars(whole)).iter().all(|c| *c == SUCCESS),
        "whole-GPU facts are read on the parent"
    );
    close();
}

#[test]
fn a_failing_device_answers_unknown_and_a_lost_one_gpu_is_lost() {
    let _machine = machine();
    let files = open("a100-mig-mixed");
    let (uuid, _) = uuids(3);
    let (_, migs) = uuids(1);
    let mig_uuid = &migs[0].0;
    write(
        &files.telemetry,
        &format!(
            r#"{{"devices": {{"{uuid}": {{"fail": true}}, "{mig_uuid}": {{"fail": true}}}}}}"#
        ),
    );
    let (failing, mig, fine) = (gpu(3), by_uuid(mig_uuid), gpu(2));
    assert!(codes(&scalars(failing)).iter().all(|c| *c == UNKNOWN));
    assert_eq!(utilization(failing).0, UNKNOWN);
    assert_eq!(memory(failing).0, UNKNOWN);
    assert_eq!(compute(failing), Err(UNKNOWN));
    assert_eq!(mps(failing), Err(UNKNOWN));
    assert_eq!(process_utilization(failing, 0), Err(UNKNOWN));
    let mut count = 0;
    // SAFETY: live count; nothing is written on a failure.
    let code = unsafe {
        nvmlDeviceGetRetiredPages_v2(failing, DOUBLE_BIT, &mut count, null_mut(), null_mut())
    };
    assert_eq!(code, UNKNOWN);
    assert_eq!(memory(mig).0, UNKNOWN);
    assert_eq!(compute(mig), Err(UNKNOWN));
    assert_eq!(memory(by_uuid(&migs[1].0)).0, SUCCESS, "per device");
    assert!(codes(&scalars(fine)).iter().all(|c| *c == SUCCESS));

    control(&files, "lose 2");
    assert!(codes(&scalars(fine)).iter().all(|c| *c == GPU_IS_LOST));
    assert_eq!(utilization(fine).0, GPU_IS_LOST);
    assert_eq!(memory(fine).0, GPU_IS_LOST);
    assert_eq!(compute(fine), Err(GPU_IS_LOST));
    assert_eq!(process_utilization(fine, 0), Err(GPU_IS_LOST));
    close();
}

#[test]
fn a_stalled_device_holds_up_no_call_on_another_device() {
    let _machine = machine();
    let files = open("dgx-h100");
    let (stalled, _) = uuids(0);
    write(
        &files.telemetry,
        &format!(r#"{{"devices": {{"{stalled}": {{"stallMs": 3000, "temperatureC": 80}}}}}}"#),
    );
    // Handles are pointers, not `Send`: the stalled call looks its GPU up itself.
    let waiter = std::thread::spawn(|| temperature(gpu(0)));
    let deadline = Instant::now() + Duration::from_secs(20);
    while stalling::NOW.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the call on GPU 0 never stalled");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Meanwhile: discovery-like and telemetry calls on another GPU.
    let mut n = 0;
    // SAFETY: live out-pointer.
    ok(unsafe { device::nvmlDeviceGetCount_v2(&mut n) });
    let other = gpu(1);
    assert_eq!(temperature(other), (SUCCESS, 35));
    assert_eq!(memory(other).0, SUCCESS);
    assert_eq!(
        stalling::NOW.load(Ordering::SeqCst),
        1,
        "the other GPU answered while GPU 0 was still stalled"
    );
    assert_eq!(waiter.join().unwrap(), (SUCCESS, 80));
    assert_eq!(stalling::NOW.load(Ordering::SeqCst), 0);
    close();
}

/// `nvmlGpmMetricsGet` of GRAPHICS_UTIL between two samples: (code, its per-metric code, value).
fn gpm_util(a: nvmlGpmSample_t, b: nvmlGpmSample_t) -> (Ret, Ret, f64) {
    // SAFETY: all-zero is a valid nvmlGpmMetricsGet_t (null samples and strings).
    let mut r: nvmlGpmMetricsGet_t = unsafe { std::mem::zeroed() };
    r.version = NVML_GPM_METRICS_GET_VERSION;
    r.numMetrics = 1;
    (r.sample1, r.sample2) = (a, b);
    r.metrics[0].metricId = nvmlGpmMetricId_t_NVML_GPM_METRIC_GRAPHICS_UTIL;
    // SAFETY: live request.
    let code = unsafe { gpm::nvmlGpmMetricsGet(&mut r) };
    (code, r.metrics[0].nvmlReturn, r.metrics[0].value)
}

fn gpm_sample() -> nvmlGpmSample_t {
    let mut s = null_mut();
    // SAFETY: live out-pointer.
    ok(unsafe { gpm::nvmlGpmSampleAlloc(&mut s) });
    s
}

#[test]
fn gpm_gives_a_mig_instances_utilization_between_two_samples_on_hopper_only() {
    let _machine = machine();
    let files = open("h100-mig-single");
    let (gpu_uuid, migs) = uuids(0);
    let (mig, gi, _) = migs[0].clone();
    write(
        &files.telemetry,
        &format!(r#"{{"devices": {{"{mig}": {{"gpuUtil": 60}}}}}}"#),
    );
    let gpu = by_uuid(&gpu_uuid);
    let mut support = nvmlGpmSupport_t {
        version: NVML_GPM_SUPPORT_VERSION,
        isSupportedDevice: 0,
    };
    // SAFETY: live out-pointer.
    ok(unsafe { gpm::nvmlGpmQueryDeviceSupport(gpu, &mut support) });
    assert_eq!(support.isSupportedDevice, 1);
    let (a, b) = (gpm_sample(), gpm_sample());
    // SAFETY: the parent GPU's handle and live samples, as nvml.h asks.
    ok(unsafe { gpm::nvmlGpmMigSampleGet(gpu, gi, a) });
    // One sample, or the same twice, spans no time: nothing to compute.
    assert_eq!(gpm_util(a, a).0, INVALID_ARGUMENT);
    std::thread::sleep(Duration::from_millis(20));
    // SAFETY: as above.
    ok(unsafe { gpm::nvmlGpmMigSampleGet(gpu, gi, b) });
    let (code, metric, value) = gpm_util(a, b);
    assert_eq!((code, metric), (SUCCESS, SUCCESS));
    assert!((value - 60.0).abs() < 1e-6, "{value}");
    // A sample of another device does not pair with it; a GPU instance that is not there.
    let c = gpm_sample();
    // SAFETY: as above.
    ok(unsafe { gpm::nvmlGpmSampleGet(gpu, c) });
    assert_eq!(gpm_util(a, c).0, INVALID_ARGUMENT);
    // SAFETY: as above.
    assert_eq!(unsafe { gpm::nvmlGpmMigSampleGet(gpu, 99, c) }, NOT_FOUND);
    for s in [a, b, c] {
        // SAFETY: allocated above, freed once.
        ok(unsafe { gpm::nvmlGpmSampleFree(s) });
    }
    close();
    // No GPM before Hopper: an A100 says so and refuses samples.
    let _files = open("a100-mig-mixed");
    let (a100, _) = uuids(0);
    let a100 = by_uuid(&a100);
    // SAFETY: live out-pointer.
    ok(unsafe { gpm::nvmlGpmQueryDeviceSupport(a100, &mut support) });
    assert_eq!(support.isSupportedDevice, 0);
    let d = gpm_sample();
    // SAFETY: as above.
    assert_eq!(unsafe { gpm::nvmlGpmSampleGet(a100, d) }, NOT_SUPPORTED);
    // SAFETY: allocated above.
    ok(unsafe { gpm::nvmlGpmSampleFree(d) });
    close();
}
