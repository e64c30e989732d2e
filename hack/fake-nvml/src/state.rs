//! The fake machine: built from a simulation profile at init, mutated by control-file commands,
//! shared by every export behind one mutex.

use crate::memory_limits::MemoryLimit;
use crate::{
    Ret, DRIVER_NOT_LOADED, GPU_IS_LOST, INVALID_ARGUMENT, NOT_SUPPORTED, UNINITIALIZED, UNKNOWN,
};
use gpuplane_model::inventory::mig::{self, MigCatalogue};
use gpuplane_model::inventory::{Gpu, Inventory, MigDevice};
use gpuplane_model::sim::instances::InstanceBook;
use gpuplane_model::sim::{self, ProfileFile};
use gpuplane_model::source::ComputeMode;
use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlEventTypeXidCriticalError};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ffi::{CStr, CString};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

pub(crate) const PROFILE_ENV: &str = "GPUPLANE_FAKE_NVML_PROFILE";
pub(crate) const CONTROL_ENV: &str = "GPUPLANE_FAKE_NVML_CONTROL";
/// The state file's variable (`persist.rs`); public for the fake MPS daemon, which reads the
/// cgroup memory limits there ([`crate::cgroup_memory_limit`]).
pub const STATE_ENV: &str = "GPUPLANE_FAKE_NVML_STATE";
pub(crate) const XID: u64 = nvmlEventTypeXidCriticalError as u64;
pub(crate) const NO_INSTANCE: u32 = u32::MAX;

/// What a handle points at. Encoded as `kind << 28 | gpu << 16 | sub`, never zero; a MIG
/// device or compute instance's `sub` is `gi << 8 | ci`.
///
/// MIG devices and instances are named by their ids, not by a position in a list, so a handle
/// to a destroyed instance stays invalid (`NVML_ERROR_INVALID_ARGUMENT`) rather than pointing at
/// whichever device took its place, until an instance with the same ids is created again (NVML
/// documents that handles may be reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handle {
    Gpu(u32),
    /// The MIG device of compute instance `ci` in GPU instance `gi`.
    Mig {
        gpu: u32,
        gi: u32,
        ci: u32,
    },
    GpuInstance {
        gpu: u32,
        id: u32,
    },
    EventSet(u32),
    ComputeInstance {
        gpu: u32,
        gi: u32,
        ci: u32,
    },
}

impl Handle {
    fn parts(self) -> (usize, u32, u32) {
        match self {
            Handle::Gpu(g) => (1, g, 0),
            Handle::Mig { gpu, gi, ci } => (2, gpu, gi << 8 | ci),
            Handle::GpuInstance { gpu, id } => (3, gpu, id),
            Handle::EventSet(id) => (4, 0, id),
            Handle::ComputeInstance { gpu, gi, ci } => (5, gpu, gi << 8 | ci),
        }
    }

    pub(crate) fn address(self) -> usize {
        let (kind, gpu, sub) = self.parts();
        kind << 28 | ((gpu as usize) & 0xfff) << 16 | ((sub as usize) & 0xffff)
    }

    pub(crate) fn from_address(address: usize) -> Option<Handle> {
        let (kind, gpu, sub) = (
            address >> 28,
            (address >> 16 & 0xfff) as u32,
            (address & 0xffff) as u32,
        );
        let handle = match kind {
            1 if sub == 0 => Handle::Gpu(gpu),
            2 => Handle::Mig {
                gpu,
                gi: sub >> 8,
                ci: sub & 0xff,
            },
            3 => Handle::GpuInstance { gpu, id: sub },
            4 if gpu == 0 => Handle::EventSet(sub),
            5 => Handle::ComputeInstance {
                gpu,
                gi: sub >> 8,
                ci: sub & 0xff,
            },
            _ => return None,
        };
        (handle.address() == address).then_some(handle)
    }

    pub(crate) fn ptr<T>(self) -> *mut T {
        std::ptr::without_provenance_mut(self.address())
    }

    pub(crate) fn of<T>(ptr: *mut T) -> Option<Handle> {
        Handle::from_address(ptr.addr())
    }
}

/// The far end of one NVLink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkEnd {
    Gpu(u32),
    Switch(u32),
}

/// Facts the inventory does not carry: the MIG table and the NVLink layout.
pub(crate) struct GpuExtra {
    pub catalogue: Option<&'static MigCatalogue>,
    /// Link number → far end; links past the end are inactive.
    pub links: Vec<LinkEnd>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Event {
    pub gpu: u32,
    pub event_type: u64,
    pub data: u64,
    pub gpu_instance: u32,
    pub compute_instance: u32,
}

#[derive(Default)]
pub(crate) struct EventSet {
    /// GPU index → registered event types.
    pub registered: BTreeMap<u32, u64>,
    pub queue: VecDeque<Event>,
}

struct Control {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

pub(crate) struct Fake {
    pub inventory: Inventory,
    pub extra: Vec<GpuExtra>,
    /// Per GPU index: its bare GPU instances and creation count (`sim::instances`).
    pub books: Vec<InstanceBook>,
    /// Per GPU index: its compute mode (`compute_mode.rs`), `Default` as after a driver load.
    pub compute_modes: Vec<ComputeMode>,
    /// Every GPU's cgroup memory limits (`memory_limits.rs`).
    pub memory_limits: Vec<MemoryLimit>,
    /// Where created and destroyed MIG instances and set compute modes are kept across
    /// processes (`STATE_ENV`).
    state_file: Option<PathBuf>,
    pub lost: BTreeSet<u32>,
    pub sets: BTreeMap<u32, EventSet>,
    pub next_set: u32,
    control: Option<Control>,
    /// The telemetry file and its last good content (`telemetry.rs`).
    pub telemetry: crate::telemetry::Telemetry,
}

/// A device handle resolved against the machine.
pub(crate) enum Dev<'a> {
    Gpu(u32, &'a Gpu),
    Mig(u32, &'a Gpu, &'a MigDevice),
}

struct Global {
    refs: u32,
    fake: Option<Fake>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    refs: 0,
    fake: None,
});
static INIT_ERROR: Mutex<Option<&'static CStr>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `nvmlInit_v2`: builds the machine on the first init (reference counted, like NVML).
pub(crate) fn init() -> Result<(), Ret> {
    let mut global = lock(&GLOBAL);
    if global.fake.is_none() {
        if init_refused() {
            return Err(DRIVER_NOT_LOADED);
        }
        match Fake::from_env() {
            Ok(fake) => global.fake = Some(fake),
            Err(reason) => {
                let _ = writeln!(std::io::stderr(), "{reason}");
                let text = CString::new(reason.replace('\0', " ")).unwrap_or_default();
                *lock(&INIT_ERROR) = Some(Box::leak(text.into_boxed_c_str()));
                return Err(UNKNOWN);
            }
        }
    }
    global.refs += 1;
    Ok(())
}

/// Whether the control file's last `init-fail` / `init-ok` line is `init-fail`.
fn init_refused() -> bool {
    let Some(path) = std::env::var_os(CONTROL_ENV) else {
        return false;
    };
    let Ok(text) = std::fs::read_to_string(path) else {
        return false;
    };
    // The last init line wins.
    text.lines()
        .rev()
        .find_map(|l| match l.split('#').next().unwrap_or("").trim() {
            "init-fail" => Some(true),
            "init-ok" => Some(false),
            _ => None,
        })
        .unwrap_or(false)
}

/// `nvmlShutdown`: the last shutdown discards the machine, so the next init reads the
/// environment again.
pub(crate) fn shutdown() -> Result<(), Ret> {
    let mut global = lock(&GLOBAL);
    if global.refs == 0 {
        return Err(UNINITIALIZED);
    }
    global.refs -= 1;
    if global.refs == 0 {
        global.fake = None;
    }
    Ok(())
}

pub(crate) fn init_error() -> Option<&'static CStr> {
    *lock(&INIT_ERROR)
}

/// Runs `f` on the machine after applying any new control commands.
pub(crate) fn with_fake<R>(f: impl FnOnce(&mut Fake) -> Result<R, Ret>) -> Result<R, Ret> {
    let mut global = lock(&GLOBAL);
    let fake = global.fake.as_mut().ok_or(UNINITIALIZED)?;
    fake.poll_control();
    f(fake)
}

impl Fake {
    fn from_env() -> Result<Fake, String> {
        let spec = std::env::var(PROFILE_ENV).map_err(|_| {
            format!("fake NVML: {PROFILE_ENV} is not set; set it to a bundled simulation profile ({}) or a profile file path", sim::bundled_names().join(", "))
        })?;
        let inventory = sim::load(&spec).map_err(|e| format!("fake NVML: {e}"))?;
        // The loader validated the file; read it again for the facts the inventory omits.
        let text = match sim::bundled_text(&spec) {
            Some(t) => t.to_string(),
            None => {
                std::fs::read_to_string(&spec).map_err(|e| format!("fake NVML: {spec}: {e}"))?
            }
        };
        let file: ProfileFile =
            serde_yaml_ng::from_str(&text).map_err(|e| format!("fake NVML: {spec}: {e}"))?;
        let extra = extras(&inventory, &file)?;
        let control = std::env::var_os(CONTROL_ENV).map(|p| Control {
            path: PathBuf::from(p),
            offset: 0,
            partial: Vec::new(),
        });
        let mut inventory = inventory;
        if let Some(version) = crate::system::driver_version_override()? {
            inventory.driver_version = version;
        }
        let mut books = vec![InstanceBook::default(); inventory.gpus.len()];
        let mut compute_modes = vec![ComputeMode::Default; inventory.gpus.len()];
        let mut memory_limits = Vec::new();
        let state_file = std::env::var_os(STATE_ENV).map(PathBuf::from);
        if let Some(path) = &state_file {
            let (modes, limits) = (&mut compute_modes, &mut memory_limits);
            crate::persist::load(path, &mut inventory, &mut books, modes, limits)?;
        }
        Ok(Fake {
            inventory,
            extra,
            books,
            compute_modes,
            memory_limits,
            state_file,
            lost: BTreeSet::new(),
            sets: BTreeMap::new(),
            next_set: 1,
            control,
            telemetry: crate::telemetry::Telemetry::from_env(),
        })
    }

    /// Resolves a device handle (GPU or MIG); a lost GPU answers `GPU_IS_LOST`.
    pub(crate) fn dev(&self, handle: nvmlDevice_t) -> Result<Dev<'_>, Ret> {
        match Handle::of(handle).ok_or(INVALID_ARGUMENT)? {
            Handle::Gpu(g) => Ok(Dev::Gpu(g, self.gpu_at(g)?)),
            Handle::Mig { gpu, gi, ci } => {
                let parent = self.gpu_at(gpu)?;
                let mig = parent
                    .mig_devices
                    .iter()
                    .find(|m| m.gpu_instance_id == gi && m.compute_instance_id == ci)
                    .ok_or(INVALID_ARGUMENT)?;
                Ok(Dev::Mig(gpu, parent, mig))
            }
            _ => Err(INVALID_ARGUMENT),
        }
    }

    /// Resolves a handle that must be a whole GPU.
    pub(crate) fn gpu(&self, handle: nvmlDevice_t) -> Result<(u32, &Gpu), Ret> {
        match self.dev(handle)? {
            Dev::Gpu(i, g) => Ok((i, g)),
            Dev::Mig(..) => Err(INVALID_ARGUMENT),
        }
    }

    /// GPU by index, failing for indices past the end and for lost GPUs.
    pub(crate) fn gpu_at(&self, index: u32) -> Result<&Gpu, Ret> {
        let gpu = self
            .inventory
            .gpus
            .get(index as usize)
            .ok_or(INVALID_ARGUMENT)?;
        if self.lost.contains(&index) {
            return Err(GPU_IS_LOST);
        }
        Ok(gpu)
    }

    pub(crate) fn extra(&self, index: u32) -> Result<&GpuExtra, Ret> {
        self.extra.get(index as usize).ok_or(INVALID_ARGUMENT)
    }

    /// Runs a MIG instance change on GPU `index`, which must answer, support MIG and be in MIG
    /// mode (else `NVML_ERROR_NOT_SUPPORTED`, as NVML answers), then saves the state file.
    pub(crate) fn change_mig<R>(
        &mut self,
        index: u32,
        change: impl FnOnce(&'static MigCatalogue, &mut Gpu, &mut InstanceBook) -> Result<R, Ret>,
    ) -> Result<R, Ret> {
        let (table, current) = self.mig_table(index)?;
        if !current {
            return Err(NOT_SUPPORTED);
        }
        let gpu = self
            .inventory
            .gpus
            .get_mut(index as usize)
            .ok_or(INVALID_ARGUMENT)?;
        let book = self.books.get_mut(index as usize).ok_or(INVALID_ARGUMENT)?;
        let result = change(table, gpu, book)?;
        self.save();
        Ok(result)
    }

    /// Sets GPU `index`'s compute mode (which must answer), then saves the state file.
    pub(crate) fn set_compute_mode(&mut self, index: u32, mode: ComputeMode) -> Result<(), Ret> {
        self.gpu_at(index)?;
        let slot = self
            .compute_modes
            .get_mut(index as usize)
            .ok_or(INVALID_ARGUMENT)?;
        *slot = mode;
        self.save();
        Ok(())
    }

    /// Writes the state file, if there is one; a failure is told on stderr, and the change
    /// stands in this process.
    pub(crate) fn save(&self) {
        if let Some(path) = &self.state_file {
            let (modes, limits) = (&self.compute_modes, &self.memory_limits);
            let saved = crate::persist::save(path, &self.inventory, &self.books, modes, limits);
            if let Err(why) = saved {
                let _ = writeln!(std::io::stderr(), "fake NVML: {why}");
            }
        }
    }

    /// GPU `index`'s MIG table (`NVML_ERROR_NOT_SUPPORTED` without one) and whether MIG is on.
    pub(crate) fn mig_table(&self, index: u32) -> Result<(&'static MigCatalogue, bool), Ret> {
        let gpu = self.gpu_at(index)?;
        let table = self.extra(index)?.catalogue.ok_or(NOT_SUPPORTED)?;
        Ok((table, gpu.mig.current))
    }

    pub(crate) fn book(&self, index: u32) -> Result<&InstanceBook, Ret> {
        self.books.get(index as usize).ok_or(INVALID_ARGUMENT)
    }

    /// Queues an event on every set where the GPU is registered for its type.
    fn deliver(&mut self, event: Event) {
        for set in self.sets.values_mut() {
            if set
                .registered
                .get(&event.gpu)
                .is_some_and(|t| t & event.event_type != 0)
            {
                set.queue.push_back(event);
            }
        }
    }

    /// Reads and applies the lines appended to the control file since the last look.
    pub(crate) fn poll_control(&mut self) {
        let Some(control) = &mut self.control else {
            return;
        };
        let Ok(meta) = std::fs::metadata(&control.path) else {
            return;
        };
        if meta.len() < control.offset {
            // Truncated: start over.
            control.offset = 0;
            control.partial.clear();
        }
        if meta.len() == control.offset {
            return;
        }
        let Ok(mut file) = std::fs::File::open(&control.path) else {
            return;
        };
        let mut fresh = Vec::new();
        if file.seek(SeekFrom::Start(control.offset)).is_err()
            || file.read_to_end(&mut fresh).is_err()
        {
            return;
        }
        control.offset += fresh.len() as u64;
        control.partial.extend_from_slice(&fresh);
        let Some(end) = control.partial.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        let complete: Vec<u8> = control.partial.drain(..=end).collect();
        for line in String::from_utf8_lossy(&complete).lines() {
            if let Err(why) = self.command(line) {
                let _ = writeln!(
                    std::io::stderr(),
                    "fake NVML: ignoring control line `{line}`: {why}"
                );
            }
        }
    }

    fn command(&mut self, line: &str) -> Result<(), String> {
        let line = line.split('#').next().unwrap_or("").trim();
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((verb, args)) = words.split_first() else {
            return Ok(());
        };
        let numbers: Vec<u64> = args
            .iter()
            .map(|a| {
                a.parse::<u64>()
                    .map_err(|_| format!("`{a}` is not a number"))
            })
            .collect::<Result<_, _>>()?;
        let gpu = |n: u64| -> Result<u32, String> {
            u32::try_from(n)
                .ok()
                .filter(|g| (*g as usize) < self.inventory.gpus.len())
                .ok_or_else(|| format!("no GPU {n}"))
        };
        let instance =
            |n: u64| u32::try_from(n).map_err(|_| format!("instance id {n} is too large"));
        match (*verb, numbers.as_slice()) {
            ("xid", [g, code]) => {
                let gpu = gpu(*g)?;
                self.deliver(Event {
                    gpu,
                    event_type: XID,
                    data: *code,
                    gpu_instance: NO_INSTANCE,
                    compute_instance: NO_INSTANCE,
                });
            }
            ("xid", [g, code, gi, ci]) => {
                let event = Event {
                    gpu: gpu(*g)?,
                    event_type: XID,
                    data: *code,
                    gpu_instance: instance(*gi)?,
                    compute_instance: instance(*ci)?,
                };
                self.deliver(event);
            }
            ("lose", [g]) => {
                let gpu = gpu(*g)?;
                if !self.lost.contains(&gpu) {
                    self.deliver(Event {
                        gpu,
                        event_type: XID,
                        data: 79,
                        gpu_instance: NO_INSTANCE,
                        compute_instance: NO_INSTANCE,
                    });
                    self.lost.insert(gpu);
                    for set in self.sets.values_mut() {
                        set.registered.remove(&gpu);
                    }
                }
            }
            ("restore", [g]) => {
                let gpu = gpu(*g)?;
                self.lost.remove(&gpu);
            }
            // Read by `init` only.
            ("init-fail" | "init-ok", []) => {}
            _ => return Err(
                "expected `xid G CODE [GI CI]`, `lose G`, `restore G`, `init-fail` or `init-ok`"
                    .into(),
            ),
        }
        Ok(())
    }
}

/// Per-GPU MIG table and NVLink layout, from the profile file.
fn extras(inventory: &Inventory, file: &ProfileFile) -> Result<Vec<GpuExtra>, String> {
    let mut out = Vec::with_capacity(inventory.gpus.len());
    for (i, spec) in file.gpus.iter().enumerate() {
        let model = file
            .models
            .get(&spec.model)
            .ok_or_else(|| format!("fake NVML: gpus[{i}]: no model `{}`", spec.model))?;
        let catalogue = model.mig_catalogue.as_deref().and_then(mig::catalogue);
        let links = if inventory.topology.nvswitch {
            (0..model.nvlinks).map(|l| LinkEnd::Switch(l % 4)).collect()
        } else {
            let me = i as u32;
            let mut links = Vec::new();
            for link in inventory.topology.links.iter().filter(|l| l.nvlinks > 0) {
                let peer = if link.from == me {
                    link.to
                } else if link.to == me {
                    link.from
                } else {
                    continue;
                };
                links.extend(std::iter::repeat_n(
                    LinkEnd::Gpu(peer),
                    link.nvlinks as usize,
                ));
            }
            links
        };
        out.push(GpuExtra { catalogue, links });
    }
    Ok(out)
}
