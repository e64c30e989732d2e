//! The dynamic-MIG, compute-mode and memory-limit exports called in process, for NVML's return
//! codes (the shell's tests see only what `NvmlSource` makes of them). The machine and the
//! environment it is built from are process-wide, so each test holds [`MACHINE`] throughout.

use crate::*;
use std::path::{Path, PathBuf};
use std::ptr::null_mut;
use std::sync::{Mutex, MutexGuard};
use tempfile::TempDir;

/// Held by each test for its whole run: one machine, one environment.
static MACHINE: Mutex<()> = Mutex::new(());

pub(crate) fn machine() -> MutexGuard<'static, ()> {
    MACHINE.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn ok(code: Ret) {
    assert_eq!(code, SUCCESS, "{:?}", error_string(code));
}

fn open(profile: &str) {
    open_with_state(profile, None);
}

/// Builds the machine of `profile`, keeping its changes in `state` if given.
fn open_with_state(profile: &str, state: Option<&Path>) {
    open_with(profile, state, None);
}

/// [`open_with_state`], reporting driver version `driver` instead of the profile's if given.
fn open_with(profile: &str, state: Option<&Path>, driver: Option<&str>) {
    std::env::set_var(state::PROFILE_ENV, profile);
    std::env::remove_var(state::CONTROL_ENV);
    match driver {
        Some(v) => std::env::set_var(system::DRIVER_VERSION_ENV, v),
        None => std::env::remove_var(system::DRIVER_VERSION_ENV),
    }
    match state {
        Some(path) => std::env::set_var(state::STATE_ENV, path),
        None => std::env::remove_var(state::STATE_ENV),
    }
    ok(nvmlInit_v2());
}

pub(crate) fn gpu(index: u32) -> nvmlDevice_t {
    let mut device = null_mut();
    // SAFETY: live out-pointer.
    ok(unsafe { device::nvmlDeviceGetHandleByIndex_v2(index, &mut device) });
    device
}

fn place(start: u32, size: u32) -> nvmlGpuInstancePlacement_t {
    nvmlGpuInstancePlacement_t { start, size }
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`: the code and the instance.
fn create_gi(
    device: nvmlDevice_t,
    profile_id: u32,
    at: nvmlGpuInstancePlacement_t,
) -> (Ret, nvmlGpuInstance_t) {
    let mut gi = null_mut();
    // SAFETY: live placement and out-pointer.
    let code = unsafe {
        instances::nvmlDeviceCreateGpuInstanceWithPlacement(device, profile_id, &at, &mut gi)
    };
    (code, gi)
}

fn create_ci(gi: nvmlGpuInstance_t, profile: u32) -> (Ret, nvmlComputeInstance_t) {
    let mut ci = null_mut();
    // SAFETY: live out-pointer.
    let code = unsafe { compute::nvmlGpuInstanceCreateComputeInstance(gi, profile, &mut ci) };
    (code, ci)
}

fn mig_off_refuses_creation_but_lists_placements() {
    open("dgx-h100");
    let h100 = gpu(0);
    let mut count = 0;
    // SAFETY: a null buffer asks for the count; live out-pointer.
    ok(unsafe {
        instances::nvmlDeviceGetGpuInstancePossiblePlacements_v2(h100, 9, null_mut(), &mut count)
    });
    assert_eq!(count, 2, "3g.40gb: slices 0 and 4, MIG on or off");
    let mut buf = [place(9, 9); 2];
    let mut small = 1;
    // SAFETY: `small` says the buffer's true capacity or less.
    let code = unsafe {
        instances::nvmlDeviceGetGpuInstancePossiblePlacements_v2(
            h100,
            9,
            buf.as_mut_ptr(),
            &mut small,
        )
    };
    assert_eq!((code, small), (INSUFFICIENT_SIZE, 2));
    // SAFETY: the buffer holds `count` entries.
    ok(unsafe {
        instances::nvmlDeviceGetGpuInstancePossiblePlacements_v2(
            h100,
            9,
            buf.as_mut_ptr(),
            &mut count,
        )
    });
    assert_eq!([buf[0].start, buf[1].start, buf[1].size], [0, 4, 4]);
    assert_eq!(create_gi(h100, 9, place(0, 4)).0, NOT_SUPPORTED);
    ok(nvmlShutdown());
}

#[test]
fn gpu_and_compute_instances_answer_with_nvmls_return_codes() {
    let _machine = machine();
    mig_off_refuses_creation_but_lists_placements();
    open("dynamic-mig-mixed");
    let (h100, l4) = (gpu(0), gpu(3));
    assert_eq!(
        create_gi(l4, 5, place(0, 4)).0,
        NOT_SUPPORTED,
        "no MIG on an L4"
    );
    // 4g.40gb is profile id 5, 3g.40gb 9, 1g.10gb+me 20.
    let (code, gi) = create_gi(h100, 5, place(0, 4));
    ok(code);
    assert_eq!(
        create_gi(h100, 9, place(0, 4)).0,
        INSUFFICIENT_RESOURCES,
        "overlap"
    );
    assert_eq!(
        create_gi(h100, 9, place(2, 4)).0,
        INVALID_ARGUMENT,
        "start not allowed"
    );
    assert_eq!(
        create_gi(h100, 9, place(4, 3)).0,
        INVALID_ARGUMENT,
        "wrong size"
    );
    assert_eq!(
        create_gi(h100, 99, place(0, 8)).0,
        INVALID_ARGUMENT,
        "no such profile"
    );

    let mut info = nvmlGpuInstanceInfo_t {
        device: null_mut(),
        id: 0,
        profileId: 0,
        placement: place(9, 9),
    };
    // SAFETY: live out-pointer.
    ok(unsafe { instances::nvmlGpuInstanceGetInfo(gi, &mut info) });
    assert_eq!(
        (
            info.id,
            info.profileId,
            info.placement.start,
            info.placement.size
        ),
        (1, 5, 0, 4)
    );
    let mut found = null_mut();
    // SAFETY: live out-pointers.
    unsafe {
        ok(instances::nvmlDeviceGetGpuInstanceById(h100, 1, &mut found));
        assert_eq!(found, gi);
        assert_eq!(
            instances::nvmlDeviceGetGpuInstanceById(h100, 2, &mut found),
            NOT_FOUND
        );
    }
    let mut listed = [null_mut(); 1];
    let mut n = 0;
    // SAFETY: the buffer holds 4g.40gb's instance count (1).
    ok(unsafe { instances::nvmlDeviceGetGpuInstances(h100, 5, listed.as_mut_ptr(), &mut n) });
    assert_eq!((n, listed[0]), (1, gi));
    let mut mig = null_mut();
    // SAFETY: live out-pointer.
    let none = unsafe { mig::nvmlDeviceGetMigDeviceHandleByIndex(h100, 0, &mut mig) };
    assert_eq!(
        none, NOT_FOUND,
        "a GPU instance without a compute instance is no MIG device"
    );

    let mut ci_info = nvmlComputeInstanceProfileInfo_t {
        id: 0,
        sliceCount: 0,
        instanceCount: 0,
        multiprocessorCount: 0,
        sharedCopyEngineCount: 0,
        sharedDecoderCount: 0,
        sharedEncoderCount: 0,
        sharedJpegCount: 0,
        sharedOfaCount: 0,
    };
    // SAFETY: live out-pointers.
    unsafe {
        assert_eq!(
            compute::nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 0, &mut ci_info),
            NOT_SUPPORTED,
            "no 3c on a 4g"
        );
        assert_eq!(
            compute::nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 3, 1, &mut ci_info),
            INVALID_ARGUMENT,
            "engine profile"
        );
        ok(compute::nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi,
            3,
            0,
            &mut ci_info,
        ));
    }
    assert_eq!(
        (ci_info.id, ci_info.sliceCount, ci_info.instanceCount),
        (3, 4, 1)
    );
    assert_eq!(
        create_ci(gi, 0).0,
        NOT_SUPPORTED,
        "only whole-instance compute instances"
    );
    let (code, ci) = create_ci(gi, 3);
    ok(code);
    assert_eq!(
        create_ci(gi, 3).0,
        INSUFFICIENT_RESOURCES,
        "the slices are taken"
    );
    // SAFETY: live out-pointer.
    ok(unsafe { mig::nvmlDeviceGetMigDeviceHandleByIndex(h100, 0, &mut mig) });
    // SAFETY: the instance still has its compute instance.
    assert_eq!(unsafe { instances::nvmlGpuInstanceDestroy(gi) }, IN_USE);
    let mut cis = [null_mut(); 1];
    // SAFETY: the buffer holds the 4-slice CI profile's instance count (1).
    ok(unsafe { compute::nvmlGpuInstanceGetComputeInstances(gi, 3, cis.as_mut_ptr(), &mut n) });
    assert_eq!((n, cis[0]), (1, ci));

    // SAFETY: handles from the calls above; a destroyed one is invalid afterwards.
    unsafe {
        ok(compute::nvmlComputeInstanceDestroy(ci));
        assert_eq!(compute::nvmlComputeInstanceDestroy(ci), INVALID_ARGUMENT);
        ok(instances::nvmlGpuInstanceDestroy(gi));
        assert_eq!(instances::nvmlGpuInstanceDestroy(gi), INVALID_ARGUMENT);
        assert_eq!(
            instances::nvmlDeviceGetGpuInstanceById(h100, 1, &mut found),
            NOT_FOUND
        );
    }

    // One +me instance: the H100 has one OFA engine.
    ok(create_gi(h100, 20, place(0, 1)).0);
    assert_eq!(
        create_gi(h100, 20, place(1, 1)).0,
        INSUFFICIENT_RESOURCES,
        "engines"
    );
    ok(nvmlShutdown());
}

/// `nvmlDeviceGetComputeMode`: the code and the mode (`u32::MAX` where none was written).
fn compute_mode(device: nvmlDevice_t) -> (Ret, nvmlComputeMode_t) {
    let mut mode = u32::MAX;
    // SAFETY: live out-pointer.
    let code = unsafe { compute_mode::nvmlDeviceGetComputeMode(device, &mut mode) };
    (code, mode)
}

const DEFAULT: nvmlComputeMode_t = nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT;
const PROHIBITED: nvmlComputeMode_t = nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED;
const EXCLUSIVE_PROCESS: nvmlComputeMode_t =
    nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_PROCESS;

/// A state file path of this process's own, removed first.
fn state_file(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("fake-nvml-{}-{name}.json", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

#[test]
fn compute_modes_are_set_per_gpu_refused_for_bad_modes_and_mig_handles() {
    let _machine = machine();
    open("dynamic-mig-mixed");
    let (h100, l4) = (gpu(0), gpu(3));
    assert_eq!(compute_mode(h100), (SUCCESS, DEFAULT), "DEFAULT until set");
    ok(compute_mode::nvmlDeviceSetComputeMode(
        h100,
        EXCLUSIVE_PROCESS,
    ));
    assert_eq!(compute_mode(h100), (SUCCESS, EXCLUSIVE_PROCESS));
    assert_eq!(compute_mode(l4), (SUCCESS, DEFAULT), "per GPU");
    ok(compute_mode::nvmlDeviceSetComputeMode(l4, PROHIBITED));
    assert_eq!(compute_mode(l4), (SUCCESS, PROHIBITED));

    let exclusive_thread = nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_THREAD;
    assert_eq!(
        compute_mode::nvmlDeviceSetComputeMode(h100, exclusive_thread),
        NOT_SUPPORTED,
        "support removed"
    );
    for bad in [nvmlComputeMode_enum_NVML_COMPUTEMODE_COUNT, 99, u32::MAX] {
        assert_eq!(
            compute_mode::nvmlDeviceSetComputeMode(h100, bad),
            INVALID_ARGUMENT,
            "mode {bad}"
        );
    }
    assert_eq!(
        compute_mode(h100),
        (SUCCESS, EXCLUSIVE_PROCESS),
        "unchanged"
    );
    // SAFETY: a null out-pointer is what is tested; the fake checks it.
    let null = unsafe { compute_mode::nvmlDeviceGetComputeMode(h100, null_mut()) };
    assert_eq!(null, INVALID_ARGUMENT);
    let bogus: nvmlDevice_t = std::ptr::without_provenance_mut(0x7);
    assert_eq!(compute_mode(bogus).0, INVALID_ARGUMENT);
    assert_eq!(
        compute_mode::nvmlDeviceSetComputeMode(bogus, DEFAULT),
        INVALID_ARGUMENT
    );

    // GPU 2 holds the profile's MIG devices: their handles have no compute mode of their own.
    let mut mig = null_mut();
    // SAFETY: live out-pointer.
    ok(unsafe { mig::nvmlDeviceGetMigDeviceHandleByIndex(gpu(2), 0, &mut mig) });
    assert_eq!(compute_mode(mig), (NOT_SUPPORTED, u32::MAX));
    assert_eq!(
        compute_mode::nvmlDeviceSetComputeMode(mig, EXCLUSIVE_PROCESS),
        NOT_SUPPORTED
    );
    assert_eq!(
        compute_mode(gpu(2)),
        (SUCCESS, DEFAULT),
        "the MIG GPU's own"
    );
    ok(nvmlShutdown());

    open("dynamic-mig-mixed");
    assert_eq!(
        compute_mode(gpu(0)),
        (SUCCESS, DEFAULT),
        "without a state file a new machine starts in DEFAULT, as after a driver load"
    );
    ok(nvmlShutdown());
}

#[test]
fn a_compute_mode_set_in_one_process_is_read_back_by_the_next_from_the_state_file() {
    let _machine = machine();
    let state = state_file("compute-mode");
    open_with_state("dynamic-mig-mixed", Some(&state));
    ok(compute_mode::nvmlDeviceSetComputeMode(
        gpu(0),
        EXCLUSIVE_PROCESS,
    ));
    ok(compute_mode::nvmlDeviceSetComputeMode(gpu(3), PROHIBITED));
    ok(nvmlShutdown());

    // The last shutdown discarded the machine: this init builds a new one from the file.
    open_with_state("dynamic-mig-mixed", Some(&state));
    assert_eq!(compute_mode(gpu(0)), (SUCCESS, EXCLUSIVE_PROCESS));
    assert_eq!(compute_mode(gpu(3)), (SUCCESS, PROHIBITED));
    assert_eq!(compute_mode(gpu(1)), (SUCCESS, DEFAULT));
    let text = std::fs::read_to_string(&state).unwrap();
    assert!(
        text.contains("\"computeMode\": \"Exclusive_Process\""),
        "{text}"
    );
    ok(compute_mode::nvmlDeviceSetComputeMode(gpu(0), DEFAULT));
    ok(nvmlShutdown());

    open_with_state("dynamic-mig-mixed", Some(&state));
    assert_eq!(
        compute_mode(gpu(0)),
        (SUCCESS, DEFAULT),
        "reset, and kept so"
    );
    assert_eq!(compute_mode(gpu(3)), (SUCCESS, PROHIBITED));
    ok(nvmlShutdown());

    // A state file written before compute modes were kept has no `computeMode`: DEFAULT.
    let mut old: serde_json::Value = serde_json::from_str(&text).unwrap();
    for entry in old["gpus"].as_array_mut().unwrap() {
        entry.as_object_mut().unwrap().remove("computeMode");
    }
    std::fs::write(&state, old.to_string()).unwrap();
    open_with_state("dynamic-mig-mixed", Some(&state));
    assert_eq!(compute_mode(gpu(0)), (SUCCESS, DEFAULT));
    assert_eq!(compute_mode(gpu(3)), (SUCCESS, DEFAULT));
    ok(nvmlShutdown());

    // An unknown mode in the file fails the init, naming the file.
    std::fs::write(&state, text.replace("Prohibited", "Exclusive_Thread")).unwrap();
    std::env::set_var(state::STATE_ENV, &state);
    assert_eq!(nvmlInit_v2(), UNKNOWN);
    let why = error_string(UNKNOWN).to_string_lossy().into_owned();
    assert!(why.contains("computeMode"), "{why}");
    std::env::remove_var(state::STATE_ENV);
    let _ = std::fs::remove_file(&state);
}

const GIB: u64 = 1 << 30;

/// `nvmlDeviceSetMemoryLimits_v1` on `cgroup`.
fn set_limits(device: nvmlDevice_t, cgroup: &str, soft: u64, hard: u64) -> Ret {
    let name = std::ffi::CString::new(cgroup).unwrap();
    let mut limits = memory_limits::nvmlSetMemoryLimits_v1_t {
        nameSpace: name.as_ptr(),
        softLimit: soft,
        hardLimit: hard,
    };
    // SAFETY: a live struct whose string outlives the call.
    unsafe { memory_limits::nvmlDeviceSetMemoryLimits_v1(device, &mut limits) }
}

/// `nvmlDeviceGetMemoryLimits_v1` on `cgroup`: the code and (soft, hard, used), `u64::MAX`
/// where nothing was written.
fn get_limits(device: nvmlDevice_t, cgroup: &str) -> (Ret, (u64, u64, u64)) {
    let name = std::ffi::CString::new(cgroup).unwrap();
    let mut limits = memory_limits::nvmlGetMemoryLimits_v1_t {
        nameSpace: name.as_ptr(),
        softLimit: u64::MAX,
        hardLimit: u64::MAX,
        currentUsed: u64::MAX,
    };
    // SAFETY: a live struct whose string outlives the call.
    let code = unsafe { memory_limits::nvmlDeviceGetMemoryLimits_v1(device, &mut limits) };
    (
        code,
        (limits.softLimit, limits.hardLimit, limits.currentUsed),
    )
}

/// The caller's effective user as the memory-limit calls see it (`None`: the real one).
fn run_as(uid: Option<u32>) {
    *memory_limits::TEST_EUID.lock().unwrap() = uid;
}

/// Makes directory `d` stand for a cgroup v2 one, as the fake tells them.
fn mark_cgroup(d: &std::path::Path) {
    std::fs::write(d.join("cgroup.controllers"), "").unwrap();
}

/// `<tmp>/pod/ctr/leaf`, standing for a pod's cgroup, a container's and one below it.
fn cgroups() -> (TempDir, String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let pod = std::fs::canonicalize(dir.path()).unwrap().join("pod");
    std::fs::create_dir_all(pod.join("ctr/leaf")).unwrap();
    for d in [pod.clone(), pod.join("ctr"), pod.join("ctr/leaf")] {
        mark_cgroup(&d);
    }
    let s = |p: PathBuf| p.to_str().unwrap().to_string();
    (
        dir,
        s(pod.clone()),
        s(pod.join("ctr")),
        s(pod.join("ctr/leaf")),
    )
}

fn driver_version() -> String {
    let mut buf = [0 as std::ffi::c_char; 80];
    // SAFETY: the buffer's true length.
    ok(unsafe { system::nvmlSystemGetDriverVersion(buf.as_mut_ptr(), 80) });
    // SAFETY: NUL-terminated by the call.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn memory_limits_exist_from_driver_r615_on_and_the_version_can_be_overridden() {
    let _machine = machine();
    let (_dir, pod, _, _) = cgroups();
    run_as(Some(0));
    open("dgx-h100");
    assert!(driver_version().starts_with("550."), "the profile's");
    assert_eq!(set_limits(gpu(0), &pod, 0, GIB), FUNCTION_NOT_FOUND_CODE);
    assert_eq!(get_limits(gpu(0), &pod).0, FUNCTION_NOT_FOUND_CODE);
    assert_eq!(
        error_string(FUNCTION_NOT_FOUND_CODE).to_str().unwrap(),
        "Function Not Found"
    );
    ok(nvmlShutdown());

    open_with("dgx-h100", None, Some("615.20.01"));
    assert_eq!(driver_version(), "615.20.01");
    let mut buf = [0 as std::ffi::c_char; 80];
    // SAFETY: the buffer's true length.
    ok(unsafe { system::nvmlSystemGetNVMLVersion(buf.as_mut_ptr(), 80) });
    // SAFETY: NUL-terminated by the call.
    let nvml = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    assert_eq!(nvml.to_str().unwrap(), "12.615.20.01");
    assert_eq!(get_limits(gpu(0), &pod).0, NOT_FOUND, "there, no limit yet");
    ok(set_limits(gpu(0), &pod, 0, GIB));
    ok(nvmlShutdown());

    open_with("dgx-h100", None, Some("614.99"));
    assert_eq!(set_limits(gpu(0), &pod, 0, GIB), FUNCTION_NOT_FOUND_CODE);
    ok(nvmlShutdown());

    std::env::set_var(system::DRIVER_VERSION_ENV, "615.x");
    assert_eq!(nvmlInit_v2(), UNKNOWN);
    let why = error_string(UNKNOWN).to_string_lossy().into_owned();
    assert!(why.contains("GPUPLANE_FAKE_NVML_DRIVER_VERSION"), "{why}");
    std::env::remove_var(system::DRIVER_VERSION_ENV);
    run_as(None);
}

const FUNCTION_NOT_FOUND_CODE: Ret = memory_limits::FUNCTION_NOT_FOUND;
const NO_PERMISSION_CODE: Ret = memory_limits::NO_PERMISSION;

#[test]
fn memory_limit_calls_refuse_bad_arguments_mig_handles_missing_cgroups_and_non_root_setters() {
    let _machine = machine();
    let (dir, pod, _, _) = cgroups();
    run_as(Some(0));
    open_with("dynamic-mig-mixed", None, Some("615.20.01"));
    let h100 = gpu(0);
    // SAFETY: null structs are what is tested; the fake checks them.
    unsafe {
        let set = memory_limits::nvmlDeviceSetMemoryLimits_v1(h100, null_mut());
        let get = memory_limits::nvmlDeviceGetMemoryLimits_v1(h100, null_mut());
        assert_eq!((set, get), (INVALID_ARGUMENT, INVALID_ARGUMENT));
    }
    let mut no_name = memory_limits::nvmlSetMemoryLimits_v1_t {
        nameSpace: std::ptr::null(),
        softLimit: 0,
        hardLimit: GIB,
    };
    // SAFETY: a live struct; its null string is what is tested.
    let code = unsafe { memory_limits::nvmlDeviceSetMemoryLimits_v1(h100, &mut no_name) };
    assert_eq!(code, INVALID_ARGUMENT);
    let relative = pod.trim_start_matches('/');
    assert_eq!(set_limits(h100, relative, 0, GIB), INVALID_ARGUMENT);
    assert_eq!(get_limits(h100, relative).0, INVALID_ARGUMENT);
    assert_eq!(
        set_limits(h100, &pod, 2 * GIB, GIB),
        INVALID_ARGUMENT,
        "soft > hard"
    );

    let mut mig = null_mut();
    // SAFETY: live out-pointer.
    ok(unsafe { mig::nvmlDeviceGetMigDeviceHandleByIndex(gpu(2), 0, &mut mig) });
    assert_eq!(set_limits(mig, &pod, 0, GIB), NOT_SUPPORTED);
    assert_eq!(get_limits(mig, &pod).0, NOT_SUPPORTED);
    let bogus: nvmlDevice_t = std::ptr::without_provenance_mut(0x7);
    assert_eq!(set_limits(bogus, &pod, 0, GIB), INVALID_ARGUMENT);

    let missing = dir.path().join("no-such-cgroup");
    let missing = missing.to_str().unwrap();
    assert_eq!(set_limits(h100, missing, 0, GIB), NOT_FOUND);
    assert_eq!(get_limits(h100, missing).0, NOT_FOUND);
    let file = dir.path().join("memory.max");
    std::fs::write(&file, "max\n").unwrap();
    assert_eq!(set_limits(h100, file.to_str().unwrap(), 0, GIB), NOT_FOUND);

    ok(set_limits(h100, &pod, GIB, 2 * GIB));
    run_as(Some(1000));
    assert_eq!(set_limits(h100, &pod, 0, GIB), NO_PERMISSION_CODE);
    assert_eq!(
        error_string(NO_PERMISSION_CODE).to_str().unwrap(),
        "Insufficient Permissions"
    );
    assert_eq!(
        get_limits(h100, &pod),
        (SUCCESS, (GIB, 2 * GIB, 0)),
        "anyone reads, and the refused set changed nothing"
    );
    run_as(None);
    ok(nvmlShutdown());
}

#[test]
fn a_limit_covers_its_cgroup_and_descendants_until_replaced_cleared_or_the_cgroup_is_removed() {
    let _machine = machine();
    let (_dir, pod, ctr, leaf) = cgroups();
    run_as(Some(0));
    open_with("dgx-h100", None, Some("615.20.01"));
    let (g0, g1) = (gpu(0), gpu(1));
    ok(set_limits(g0, &pod, 4 * GIB, 8 * GIB));
    assert_eq!(get_limits(g0, &pod), (SUCCESS, (4 * GIB, 8 * GIB, 0)));
    assert_eq!(
        get_limits(g0, &leaf),
        (SUCCESS, (4 * GIB, 8 * GIB, 0)),
        "inherited"
    );
    assert_eq!(get_limits(g1, &pod).0, NOT_FOUND, "per GPU");
    let dotted = format!("{leaf}/../..");
    assert_eq!(
        get_limits(g0, &dotted).1,
        (4 * GIB, 8 * GIB, 0),
        "the same directory"
    );

    ok(set_limits(g0, &ctr, 0, 2 * GIB));
    assert_eq!(get_limits(g0, &leaf).1, (0, 2 * GIB, 0), "the nearest wins");
    assert_eq!(get_limits(g0, &pod).1, (4 * GIB, 8 * GIB, 0));
    ok(set_limits(g0, &format!("{pod}/"), GIB, 6 * GIB));
    assert_eq!(get_limits(g0, &pod).1, (GIB, 6 * GIB, 0), "replaced");

    ok(set_limits(g0, &ctr, 0, MEMORY_LIMIT_MAX));
    assert_eq!(
        get_limits(g0, &leaf).1,
        (GIB, 6 * GIB, 0),
        "cleared: the pod's again"
    );
    ok(set_limits(g0, &ctr, 0, 3 * GIB));
    // The container's cgroup removed and made again (the old one kept aside, so that its
    // inode cannot be reused): the new one has no limit of its own.
    std::fs::rename(&ctr, format!("{pod}/gone")).unwrap();
    std::fs::create_dir(&ctr).unwrap();
    mark_cgroup(std::path::Path::new(&ctr));
    assert_eq!(get_limits(g0, &ctr).1, (GIB, 6 * GIB, 0));
    ok(set_limits(g0, &pod, 0, MEMORY_LIMIT_MAX));
    assert_eq!(get_limits(g0, &ctr).0, NOT_FOUND);
    run_as(None);
    ok(nvmlShutdown());
}

fn inode(path: &str) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap())
}

#[test]
fn memory_limits_outlive_the_process_in_the_state_file_where_the_mps_daemon_reads_them() {
    let _machine = machine();
    let (dir, pod, ctr, leaf) = cgroups();
    let state = state_file("memory-limits");
    run_as(Some(0));
    open_with("dgx-h100", Some(&state), Some("615.20.01"));
    ok(set_limits(gpu(0), &pod, 0, 8 * GIB));
    ok(set_limits(gpu(1), &pod, 0, 6 * GIB));
    ok(set_limits(gpu(0), &ctr, 0, 10 * GIB));
    let uuid = state::with_fake(|f| Ok(f.inventory.gpus[2].uuid.to_string())).unwrap();
    ok(nvmlShutdown());

    open_with("dgx-h100", Some(&state), Some("615.20.01"));
    assert_eq!(get_limits(gpu(0), &pod).1, (0, 8 * GIB, 0));
    assert_eq!(get_limits(gpu(1), &leaf).1, (0, 6 * GIB, 0));
    // Any GPU's limit on the cgroup or an ancestor applies; the smallest wins.
    assert_eq!(cgroup_memory_limit(&state, inode(&pod)), Some(6 * GIB));
    assert_eq!(cgroup_memory_limit(&state, inode(&leaf)), Some(6 * GIB));
    assert_eq!(cgroup_memory_limit(&state, inode(&ctr)), Some(6 * GIB));
    ok(set_limits(gpu(1), &pod, 0, MEMORY_LIMIT_MAX));
    assert_eq!(cgroup_memory_limit(&state, inode(&leaf)), Some(8 * GIB));
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    mark_cgroup(&elsewhere);
    assert_eq!(
        cgroup_memory_limit(&state, inode(elsewhere.to_str().unwrap())),
        None
    );
    assert_eq!(
        cgroup_memory_limit(&dir.path().join("none.json"), inode(&pod)),
        None
    );
    ok(nvmlShutdown());

    // Written as the set call writes, for readers without a profile or root.
    record_memory_limit(&state, &uuid, &elsewhere, 0, GIB).unwrap();
    let elsewhere_inode = inode(elsewhere.to_str().unwrap());
    assert_eq!(cgroup_memory_limit(&state, elsewhere_inode), Some(GIB));
    assert!(record_memory_limit(&state, &uuid, Path::new("rel"), 0, GIB).is_err());
    assert!(record_memory_limit(&state, &uuid, &elsewhere, 2 * GIB, GIB).is_err());
    assert!(record_memory_limit(&state, &uuid, &dir.path().join("none"), 0, GIB).is_err());
    open_with("dgx-h100", Some(&state), Some("615.20.01"));
    assert_eq!(
        get_limits(gpu(2), elsewhere.to_str().unwrap()).1,
        (0, GIB, 0)
    );
    ok(nvmlShutdown());
    let fresh = dir.path().join("fresh.json");
    record_memory_limit(&fresh, &uuid, &elsewhere, 0, GIB).unwrap();
    assert_eq!(cgroup_memory_limit(&fresh, elsewhere_inode), Some(GIB));

    // A limit on a GPU the profile lacks fails the init, naming the list.
    record_memory_limit(&state, "GPU-not-here", &elsewhere, 0, GIB).unwrap();
    std::env::set_var(state::STATE_ENV, &state);
    assert_eq!(nvmlInit_v2(), UNKNOWN);
    let why = error_string(UNKNOWN).to_string_lossy().into_owned();
    assert!(why.contains("memoryLimits"), "{why}");
    std::env::remove_var(state::STATE_ENV);
    std::env::remove_var(system::DRIVER_VERSION_ENV);
    let _ = std::fs::remove_file(&state);
    run_as(None);
}
