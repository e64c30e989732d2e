//! Per-cgroup GPU memory limits: `nvmlDeviceSetMemoryLimits_v1` and
//! `nvmlDeviceGetMemoryLimits_v1`, kept per GPU UUID in the state file (`persist.rs`), and
//! [`cgroup_memory_limit`], through which the fake MPS daemon (hack/fake-mps) applies them to
//! its clients as the driver applies them to allocations.
//!
//! What NVIDIA documents, and the fake follows (NVML r615 change log; NVML API reference,
//! `nvmlSetMemoryLimits_v1_t` and `nvmlGetMemoryLimits_v1_t`; MPS documentation, "MPS v3 memory
//! partitioning", docs.nvidia.com/deploy/mps/mpsv3-memory-partitioning.html):
//! - the calls are new in driver r615 (CUDA 13.4): an older driver's library lacks them. Here a
//!   driver below 615 answers `NVML_ERROR_FUNCTION_NOT_FOUND`; the bundled profiles say 550.x,
//!   so a test names a newer one in `GPUPLANE_FAKE_NVML_DRIVER_VERSION`;
//! - `nameSpace` is the full path of a cgroup v2 directory, limits are bytes; setting "requires
//!   root/admin permissions" (`NVML_ERROR_NO_PERMISSION`), reading does not; "MIG handles are not
//!   supported" (`NVML_ERROR_NOT_SUPPORTED`); a path that is no cgroup directory is
//!   `NVML_ERROR_NOT_FOUND`;
//! - soft 0 with hard `NVML_DEVICE_MEMORY_LIMIT_MAX` clears the limits; "removing the cgroup will
//!   also clear any limits" (here: an entry whose directory no longer has the inode recorded at
//!   set time is ignored);
//! - an allocation in the cgroup, or in a descendant without a limit of its own, fails past the
//!   hard limit whatever the process's `CUDA_MPS_*` environment says (fake-mps models that).
//!
//! Fake-only: any directory holding a `cgroup.controllers` file stands for a cgroup v2 one
//! (tests use temporary ones), paths are
//! canonicalised, the soft limit is only kept and read back, and `currentUsed` is 0 (nothing
//! allocates). Where a descendant has a limit of its own, [`cgroup_memory_limit`] still applies
//! its ancestors' too (the smallest wins), as cgroup v2 limits are hierarchical; NVIDIA's page
//! does not say whether a child's larger limit lifts its parent's.

use crate::state::{with_fake, Dev, Fake};
use crate::{entry, Ret, INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED, UNKNOWN};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
    nvmlReturn_enum_NVML_ERROR_NO_PERMISSION, nvmlReturn_t,
};
use serde_json::{json, Value};
use std::ffi::{c_char, CStr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub(crate) const FUNCTION_NOT_FOUND: Ret = nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND;
pub(crate) const NO_PERMISSION: Ret = nvmlReturn_enum_NVML_ERROR_NO_PERMISSION;
/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: no hard limit (with soft 0, the limits cleared).
pub const MEMORY_LIMIT_MAX: u64 = u64::MAX;
/// The first driver branch with the calls (NVML r615 change log).
const FIRST_DRIVER: u32 = 615;
/// How deep [`cgroup_memory_limit`] looks below a limited cgroup for the client's.
const MAX_DEPTH: usize = 32;

/// nvml.h's `nvmlSetMemoryLimits_v1_t`.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlSetMemoryLimits_v1_t {
    /// [in] Full path of the cgroup v2 directory.
    pub nameSpace: *const c_char,
    /// [in] Bytes guaranteed before allocations may fail under memory pressure.
    pub softLimit: u64,
    /// [in] Bytes that can be allocated at most.
    pub hardLimit: u64,
}

/// nvml.h's `nvmlGetMemoryLimits_v1_t`.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGetMemoryLimits_v1_t {
    /// [in] Full path of the cgroup v2 directory.
    pub nameSpace: *const c_char,
    /// [out]
    pub softLimit: u64,
    /// [out]
    pub hardLimit: u64,
    /// [out] Bytes in use against the limits (0 here: nothing allocates).
    pub currentUsed: u64,
}

/// One GPU's limits on one cgroup, as set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MemoryLimit {
    pub uuid: String,
    /// Canonical path of the directory.
    pub cgroup: String,
    /// The directory's inode at set time: a cgroup removed and made again is another.
    pub inode: u64,
    pub soft: u64,
    pub hard: u64,
}

impl MemoryLimit {
    fn to_json(&self) -> Value {
        json!({"uuid": self.uuid, "cgroup": self.cgroup, "inode": self.inode,
               "softLimit": self.soft, "hardLimit": self.hard})
    }

    fn from_json(v: &Value) -> Option<MemoryLimit> {
        Some(MemoryLimit {
            uuid: v["uuid"].as_str()?.to_string(),
            cgroup: v["cgroup"].as_str()?.to_string(),
            inode: v["inode"].as_u64()?,
            soft: v["softLimit"].as_u64()?,
            hard: v["hardLimit"].as_u64()?,
        })
    }

    /// Whether its cgroup still exists, the very one it was set on.
    fn live(&self) -> bool {
        inode_of(Path::new(&self.cgroup)) == Some(self.inode)
    }
}

/// The `memoryLimits` list of a state file (absent: none).
pub(crate) fn from_state(state: &Value) -> Result<Vec<MemoryLimit>, String> {
    let Some(list) = state.get("memoryLimits") else {
        return Ok(Vec::new());
    };
    list.as_array()
        .ok_or("memoryLimits: not a list")?
        .iter()
        .map(|v| MemoryLimit::from_json(v).ok_or_else(|| format!("memoryLimits: bad entry {v}")))
        .collect()
}

pub(crate) fn to_state(limits: &[MemoryLimit]) -> Value {
    Value::Array(limits.iter().map(MemoryLimit::to_json).collect())
}

/// Records `limit`, replacing its GPU's entry for the same cgroup; soft 0 with hard max
/// clears it.
fn upsert(limits: &mut Vec<MemoryLimit>, limit: MemoryLimit) {
    limits.retain(|l| !(l.uuid == limit.uuid && l.cgroup == limit.cgroup));
    if !(limit.soft == 0 && limit.hard == MEMORY_LIMIT_MAX) {
        limits.push(limit);
    }
}

/// GPU `uuid`'s limits on `cgroup`: its own entry, else its nearest ancestor's.
fn nearest<'a>(limits: &'a [MemoryLimit], uuid: &str, cgroup: &Path) -> Option<&'a MemoryLimit> {
    cgroup.ancestors().find_map(|dir| {
        limits
            .iter()
            .find(|l| l.uuid == uuid && Path::new(&l.cgroup) == dir && l.live())
    })
}

fn inode_of(dir: &Path) -> Option<u64> {
    std::fs::metadata(dir)
        .ok()
        .filter(|m| m.is_dir())
        .map(|m| m.ino())
}

/// A `nameSpace` as given: non-null, UTF-8 and absolute, else `NVML_ERROR_INVALID_ARGUMENT`.
///
/// # Safety
/// `name` must be null or a NUL-terminated string (nvml.h contract).
unsafe fn name_space(name: *const c_char) -> Result<PathBuf, Ret> {
    if name.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let text = unsafe { CStr::from_ptr(name) }
        .to_str()
        .map_err(|_| INVALID_ARGUMENT)?;
    let path = PathBuf::from(text);
    if !path.is_absolute() {
        return Err(INVALID_ARGUMENT);
    }
    Ok(path)
}

/// The canonical path and inode of a cgroup v2 directory (it lists `cgroup.controllers`);
/// anything else, a cgroup v1 hierarchy's directory included, is `NVML_ERROR_NOT_FOUND`.
fn resolve(path: &Path) -> Result<(String, u64), Ret> {
    let canonical = std::fs::canonicalize(path).map_err(|_| NOT_FOUND)?;
    if !canonical.join("cgroup.controllers").is_file() {
        return Err(NOT_FOUND);
    }
    let inode = inode_of(&canonical).ok_or(NOT_FOUND)?;
    let text = canonical.to_str().ok_or(INVALID_ARGUMENT)?.to_string();
    Ok((text, inode))
}

/// The UUID of the GPU behind `device`, once the driver is known to have the calls.
fn gpu_uuid(f: &Fake, device: nvmlDevice_t) -> Result<String, Ret> {
    let major = crate::system::driver_major(&f.inventory.driver_version);
    if major.is_none_or(|m| m < FIRST_DRIVER) {
        return Err(FUNCTION_NOT_FOUND);
    }
    match f.dev(device)? {
        Dev::Gpu(_, gpu) => Ok(gpu.uuid.to_string()),
        Dev::Mig(..) => Err(NOT_SUPPORTED),
    }
}

/// This process's effective user: the owner of /proc/self, which needs no libc (tests stand
/// in for root, or for another user, in `TEST_EUID`).
fn effective_uid() -> Result<u32, Ret> {
    #[cfg(test)]
    if let Some(uid) = *TEST_EUID.lock().unwrap_or_else(|p| p.into_inner()) {
        return Ok(uid);
    }
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .map_err(|_| UNKNOWN)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceSetMemoryLimits_v1(
    device: nvmlDevice_t,
    limits: *mut nvmlSetMemoryLimits_v1_t,
) -> nvmlReturn_t {
    entry(|| {
        with_fake(|f| {
            let uuid = gpu_uuid(f, device)?;
            // SAFETY: null or the caller's struct (nvml.h contract).
            let wanted = unsafe { limits.as_ref() }.ok_or(INVALID_ARGUMENT)?;
            // SAFETY: the caller's string (nvml.h contract).
            let path = unsafe { name_space(wanted.nameSpace) }?;
            if wanted.softLimit > wanted.hardLimit {
                return Err(INVALID_ARGUMENT);
            }
            if effective_uid()? != 0 {
                return Err(NO_PERMISSION);
            }
            let (cgroup, inode) = resolve(&path)?;
            let (soft, hard) = (wanted.softLimit, wanted.hardLimit);
            let limit = MemoryLimit {
                uuid,
                cgroup,
                inode,
                soft,
                hard,
            };
            upsert(&mut f.memory_limits, limit);
            f.save();
            Ok(())
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryLimits_v1(
    device: nvmlDevice_t,
    limits: *mut nvmlGetMemoryLimits_v1_t,
) -> nvmlReturn_t {
    entry(|| {
        with_fake(|f| {
            let uuid = gpu_uuid(f, device)?;
            // SAFETY: null or the caller's struct (nvml.h contract).
            let out = unsafe { limits.as_mut() }.ok_or(INVALID_ARGUMENT)?;
            // SAFETY: the caller's string (nvml.h contract).
            let path = unsafe { name_space(out.nameSpace) }?;
            let (cgroup, _) = resolve(&path)?;
            let found = nearest(&f.memory_limits, &uuid, Path::new(&cgroup)).ok_or(NOT_FOUND)?;
            out.softLimit = found.soft;
            out.hardLimit = found.hard;
            out.currentUsed = 0;
            Ok(())
        })
    })
}

/// The hard limit, in bytes, that the cgroup memory limits kept in `state_file` put on a
/// process whose cgroup v2 directory has inode `cgroup_inode`: the smallest of any GPU's
/// limits on that cgroup or on an ancestor of it (the client's directory is looked for below
/// each limited one). `None` without a readable state file or a limit that applies.
pub fn cgroup_memory_limit(state_file: &Path, cgroup_inode: u64) -> Option<u64> {
    let text = std::fs::read_to_string(state_file).ok()?;
    let state: Value = serde_json::from_str(&text).ok()?;
    let all: Vec<MemoryLimit> = from_state(&state).ok()?;
    // The recorded inode names the cgroup wherever the reader's mount namespace puts it: the
    // MPS server may see another /sys/fs/cgroup than the runtime whose hook set the limit, as
    // the kernel, not a path, tells the real driver a process's cgroup.
    let own = all
        .iter()
        .filter(|l| l.inode == cgroup_inode)
        .map(|l| l.hard);
    let live: Vec<&MemoryLimit> = all.iter().filter(|l| l.live()).collect();
    let inherited = live
        .iter()
        .find_map(|l| find_dir(Path::new(&l.cgroup), cgroup_inode, MAX_DEPTH))
        .map(|dir| {
            live.iter()
                .filter(|l| dir.starts_with(&l.cgroup))
                .map(|l| l.hard)
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    own.chain(inherited)
        .min()
        .filter(|&hard| hard != MEMORY_LIMIT_MAX)
}

/// The directory at or below `root` with inode `inode`; symbolic links are not followed
/// (cgroupfs has none).
fn find_dir(root: &Path, inode: u64, depth: usize) -> Option<PathBuf> {
    if inode_of(root)? == inode {
        return Some(root.to_path_buf());
    }
    if depth == 0 {
        return None;
    }
    std::fs::read_dir(root)
        .ok()?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .find_map(|e| find_dir(&e.path(), inode, depth - 1))
}

/// Records in `state_file` what `nvmlDeviceSetMemoryLimits_v1` run as root on GPU `gpu_uuid`
/// leaves there, after the same checks (absolute path of an existing directory, soft <= hard),
/// for tests of programs that read the limits (the fake MPS daemon) without a profile loaded.
/// The rest of the file is kept; a missing one is made (no `gpus`: the profile's own).
pub fn record_memory_limit(
    state_file: &Path,
    gpu_uuid: &str,
    cgroup: &Path,
    soft: u64,
    hard: u64,
) -> Result<(), String> {
    let why = |what: &str| format!("cannot limit {} to {hard} bytes: {what}", cgroup.display());
    if !cgroup.is_absolute() || soft > hard {
        return Err(why("need an absolute path and soft <= hard"));
    }
    let (cgroup, inode) = resolve(cgroup).map_err(|_| why("no such directory"))?;
    let mut state = match std::fs::read_to_string(state_file) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| why(&e.to_string()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => json!({ "gpus": [] }),
        Err(e) => return Err(why(&e.to_string())),
    };
    let mut limits = from_state(&state).map_err(|e| why(&e))?;
    let uuid = gpu_uuid.to_string();
    upsert(
        &mut limits,
        MemoryLimit {
            uuid,
            cgroup,
            inode,
            soft,
            hard,
        },
    );
    let object = state
        .as_object_mut()
        .ok_or_else(|| why("the state file is no JSON object"))?;
    object.insert("memoryLimits".into(), to_state(&limits));
    crate::persist::write_whole(state_file, &state)
}

/// The effective user the tests make the calls as (`None`: the real one).
#[cfg(test)]
pub(crate) static TEST_EUID: std::sync::Mutex<Option<u32>> = std::sync::Mutex::new(None);
