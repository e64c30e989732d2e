//! Where the inventory comes from: the small trait the agent sees, and the simulated source.
//!
//! Two real implementations stand behind [`DeviceSource`]: `nvml::NvmlSource` (the driver, or the
//! fake libnvidia-ml in tests) and [`SimSource`] (a simulation profile, with events injected in
//! process for the demo). The agent never asks which one it talks to; whoever opens the source
//! says, as a [`DeviceMode`], whether its devices exist on this host, because only real GPUs
//! have device nodes and driver files for containers.

use crate::inventory::{DeviceUuid, Gpu, Inventory, MigDevice};
use crate::sim::instances::{self, InstanceBook};
use crate::sim::telemetry::{Answering, TelemetryFile};
use crate::telemetry::Readings;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Whether the agent's devices are real GPUs on this host or a simulation profile's.
///
/// NVML means hardware, also when it is the fake libnvidia-ml of the tests: device nodes and
/// driver files are then expected, checked and put into CDI specs. Simulated devices
/// (`gpuplane node --simulate`, e.g. trying the DRA driver on kind) have neither: their CDI
/// specs carry each device's identity in the environment, so containers still start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceMode {
    #[default]
    Hardware,
    Simulated,
}

/// What discovery found: the devices that answered, and the GPUs that did not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovery {
    pub inventory: Inventory,
    /// GPUs the driver lists but that failed to answer (e.g. fell off the bus). They are left out
    /// of `inventory`; every other GPU is still served.
    pub lost: Vec<LostGpu>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostGpu {
    pub index: u32,
    pub reason: String,
}

/// Something the driver reported about a device after discovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceEvent {
    /// A critical Xid error; `mig_uuid` is set when NVML attributes it to one MIG device.
    Xid {
        gpu_uuid: DeviceUuid,
        mig_uuid: Option<DeviceUuid>,
        xid: u64,
    },
}

/// Failure of a source as a whole (as opposed to one lost GPU).
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The NVML library could not be loaded or initialised.
    #[error("{0}")]
    Unavailable(String),
    /// A query that every GPU needs failed.
    #[error("NVML query {call} failed: {reason}")]
    Query { call: String, reason: String },
}

/// A provider of devices and device events.
pub trait DeviceSource: Send + Sync {
    /// Reads the whole inventory. A GPU that does not answer goes to `Discovery::lost`.
    fn discover(&self) -> Result<Discovery, SourceError>;

    /// Waits up to `timeout` for the next device event; `Ok(None)` when none came.
    fn next_event(&self, timeout: Duration) -> Result<Option<DeviceEvent>, SourceError>;

    /// Whether the GPU with this UUID answers queries right now. May block for as long as the
    /// driver does (NVML stalls on a GPU that fell off the bus): the agent calls it only from
    /// its probe thread (`node::lost_gpus`), never on the async runtime or under the state lock.
    fn responds(&self, gpu_uuid: &str) -> bool;

    /// The latest readings of device `uuid` (a GPU or a MIG device), for the telemetry
    /// sampler's threads only: it may block for as long as the driver does. A reading the
    /// device does not offer is `None`; a failing query fails the whole sample.
    fn sample(&self, uuid: &DeviceUuid) -> Result<Readings, SourceError>;

    /// Dynamic MIG: creates a GPU instance of `req.profile` at memory slice `req.start` of GPU
    /// `req.gpu` and one compute instance spanning it, and returns the MIG device as discovery
    /// lists it from then on. The hardware's placement rules apply
    /// ([`crate::inventory::mig::MigCatalogue::admit`]). Called by the agent's state owner only,
    /// from the blocking pool.
    fn create_mig(&self, req: &MigRequest) -> Result<MigDevice, MigChangeError>;

    /// Dynamic MIG: destroys the compute instances and then GPU instance `gpu_instance_id` of
    /// GPU `gpu`. [`MigChangeError::NotFound`] when there is no such instance (already gone).
    fn destroy_mig(&self, gpu: &DeviceUuid, gpu_instance_id: u32) -> Result<(), MigChangeError>;

    /// The compute mode of GPU `gpu`, as `nvmlDeviceGetComputeMode` reports it. MPS wants
    /// [`ComputeMode::ExclusiveProcess`] on a GPU its control daemon serves; see
    /// [`ComputeMode`]. `gpu` is a whole GPU's UUID: the simulated source and the fake NVML
    /// refuse a MIG device's ([`ComputeModeError::Refused`]); the driver is asked as given
    /// (newer NVML releases document MIG device handles for these calls).
    fn compute_mode(&self, gpu: &DeviceUuid) -> Result<ComputeMode, ComputeModeError>;

    /// Sets the compute mode of GPU `gpu`, as `nvmlDeviceSetComputeMode` (root only; the
    /// driver forgets it on a reload or reboot and comes back in `Default`). Called from the
    /// blocking pool, never on the async runtime: the driver call may block.
    fn set_compute_mode(&self, gpu: &DeviceUuid, mode: ComputeMode)
        -> Result<(), ComputeModeError>;

    /// The NVML library through which a container's cgroup can be held to part of a whole GPU's
    /// memory (`nvmlDeviceSetMemoryLimits_v1`, NVIDIA driver r615 and later, not on MIG
    /// devices; see [`crate::cdi::memory_limit`]), as this process names it: a path, or
    /// `libnvidia-ml.so.1` for the loader's. `None` where the driver has no such limit (older
    /// drivers, simulated machines): share memory limits are then cooperative only.
    fn memory_limit_library(&self) -> Option<std::path::PathBuf> {
        None
    }
}

/// A GPU's compute mode: which CUDA contexts the driver lets onto it (NVML's
/// `nvmlComputeMode_t`, NVIDIA NVML API reference, "Device Queries" `nvmlDeviceGetComputeMode`
/// and "Device Commands" `nvmlDeviceSetComputeMode`).
///
/// Why the agent cares: NVIDIA's MPS documentation asks for the GPU to be in
/// `EXCLUSIVE_PROCESS` while an MPS control daemon serves it, so that only the MPS server holds
/// a context and every client goes through it; NVIDIA's DRA driver sets it before it starts a
/// daemon and puts the GPU back to `DEFAULT` after. The setting needs root and does not outlive
/// a driver reload or reboot (Linux resets it to `DEFAULT`).
///
/// Displayed and serialized in nvidia-smi's words (`nvidia-smi -q`, "Compute Mode").
/// NVML's fourth mode, `EXCLUSIVE_THREAD` (1), is deprecated and its support removed from the
/// driver, so it has no variant here.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum ComputeMode {
    /// `NVML_COMPUTEMODE_DEFAULT` (0): any number of contexts, from any process.
    #[default]
    Default,
    /// `NVML_COMPUTEMODE_EXCLUSIVE_PROCESS` (3): contexts from one process only (the MPS
    /// server's, when MPS runs).
    #[serde(rename = "Exclusive_Process")]
    ExclusiveProcess,
    /// `NVML_COMPUTEMODE_PROHIBITED` (2): no contexts at all.
    Prohibited,
}

impl std::fmt::Display for ComputeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ComputeMode::Default => "Default",
            ComputeMode::ExclusiveProcess => "Exclusive_Process",
            ComputeMode::Prohibited => "Prohibited",
        })
    }
}

/// Why a compute mode was not read or set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ComputeModeError {
    /// No GPU with that UUID.
    #[error("{0}")]
    NotFound(String),
    /// The driver will not: not supported on this device (a MIG device, for one), or no
    /// permission (setting needs root).
    #[error("{0}")]
    Refused(String),
    /// The driver call itself failed (a lost GPU, for one).
    #[error("NVML {call} failed: {reason}")]
    Failed { call: String, reason: String },
}

/// A MIG instance to create: a GPU-instance profile (name as in the bundled tables, e.g.
/// `3g.40gb`) at a start memory slice of one GPU.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct MigRequest {
    pub gpu: DeviceUuid,
    pub profile: String,
    pub start: u32,
}

/// Why a MIG instance was not created or destroyed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigChangeError {
    /// The hardware refuses it: a placement or engine rule, a GPU not in MIG mode, a profile
    /// the GPU does not have.
    #[error("{0}")]
    Refused(String),
    /// No such GPU, or no such instance.
    #[error("{0}")]
    NotFound(String),
    /// The driver call itself failed.
    #[error("NVML {call} failed: {reason}")]
    Failed { call: String, reason: String },
}

/// A simulated machine. Clones share state, so a test or the demo can inject into a running agent.
/// MIG instances are created and destroyed as on the hardware, by [`instances`] (the fake NVML's
/// rules too): smallest free GPU-instance id from 1, compute instance 0, a new UUID per creation.
#[derive(Debug, Clone)]
pub struct SimSource {
    inner: Arc<SimState>,
}

#[derive(Debug)]
struct SimState {
    /// Locked before `books` where both are held.
    inventory: Mutex<Inventory>,
    /// Per GPU UUID, what its MIG instances need beyond the inventory (creation numbers).
    books: Mutex<BTreeMap<DeviceUuid, InstanceBook>>,
    lost: Mutex<BTreeSet<String>>,
    /// Per GPU UUID, a compute mode set since the machine was made; absent means `Default`
    /// (as after a driver load).
    compute_modes: Mutex<BTreeMap<DeviceUuid, ComputeMode>>,
    events: Mutex<std::sync::mpsc::Receiver<DeviceEvent>>,
    sender: Mutex<std::sync::mpsc::Sender<DeviceEvent>>,
    /// `discover` calls begun.
    discoveries: AtomicU64,
    /// What each device is doing ([`SimSource::set_telemetry`]).
    telemetry: Mutex<TelemetryFile>,
}

/// [`SimSource::machine`]: a simulated machine's state that outlives the agent.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SimMachine {
    pub gpus: Vec<SimGpu>,
}

/// One GPU of a [`SimMachine`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SimGpu {
    pub uuid: DeviceUuid,
    pub mig_devices: Vec<MigDevice>,
    pub book: InstanceBook,
    pub compute_mode: ComputeMode,
}

impl SimSource {
    pub fn new(inventory: Inventory) -> Self {
        let (sender, events) = std::sync::mpsc::channel();
        SimSource {
            inner: Arc::new(SimState {
                inventory: Mutex::new(inventory),
                books: Mutex::new(BTreeMap::new()),
                lost: Mutex::new(BTreeSet::new()),
                compute_modes: Mutex::new(BTreeMap::new()),
                events: Mutex::new(events),
                sender: Mutex::new(sender),
                discoveries: AtomicU64::new(0),
                telemetry: Mutex::new(TelemetryFile::default()),
            }),
        }
    }

    /// What a real driver would keep of this machine across an agent restart (not a reboot):
    /// each GPU's MIG devices and instance book, and its compute mode.
    pub fn machine(&self) -> SimMachine {
        let inventory = lock(&self.inner.inventory);
        let books = lock(&self.inner.books);
        let modes = lock(&self.inner.compute_modes);
        SimMachine {
            gpus: inventory
                .gpus
                .iter()
                .map(|g| SimGpu {
                    uuid: g.uuid.clone(),
                    mig_devices: g.mig_devices.clone(),
                    book: books.get(&g.uuid).cloned().unwrap_or_default(),
                    compute_mode: modes.get(&g.uuid).copied().unwrap_or_default(),
                })
                .collect(),
        }
    }

    /// Takes `machine`'s MIG devices, instance books and compute modes; an error names a GPU
    /// that `machine` has and this one lacks (another profile), and nothing is taken then.
    pub fn restore(&self, machine: &SimMachine) -> Result<(), String> {
        let mut inventory = lock(&self.inner.inventory);
        if let Some(missing) = machine
            .gpus
            .iter()
            .find(|m| !inventory.gpus.iter().any(|g| g.uuid == m.uuid))
        {
            return Err(format!("this machine has no GPU {}", missing.uuid));
        }
        let mut books = lock(&self.inner.books);
        let mut modes = lock(&self.inner.compute_modes);
        for saved in &machine.gpus {
            if let Some(g) = inventory.gpus.iter_mut().find(|g| g.uuid == saved.uuid) {
                g.mig_devices = saved.mig_devices.clone();
            }
            books.insert(saved.uuid.clone(), saved.book.clone());
            modes.insert(saved.uuid.clone(), saved.compute_mode);
        }
        Ok(())
    }

    /// Delivers an Xid as the driver would.
    pub fn inject_xid(&self, gpu_uuid: &DeviceUuid, mig_uuid: Option<&DeviceUuid>, xid: u64) {
        let event = DeviceEvent::Xid {
            gpu_uuid: gpu_uuid.clone(),
            mig_uuid: mig_uuid.cloned(),
            xid,
        };
        // The receiver lives as long as `inner`, which `self` keeps alive: sending cannot fail.
        let _ = lock(&self.inner.sender).send(event);
    }

    /// Makes a GPU fall off the bus (Xid 79) or, with `lost == false`, come back.
    pub fn set_lost(&self, gpu_uuid: &DeviceUuid, lost: bool) {
        if lost {
            lock(&self.inner.lost).insert(gpu_uuid.to_string());
            self.inject_xid(gpu_uuid, None, 79);
        } else {
            lock(&self.inner.lost).remove(gpu_uuid.as_str());
        }
    }

    /// How many [`DeviceSource::discover`] calls have begun, every caller's (a test's own
    /// included). An agent rediscovers one call at a time and posts each result before it
    /// begins the next, so a count read now and seen two higher later means a discovery that
    /// began after now has been handed to the agent's state owner.
    pub fn discoveries(&self) -> u64 {
        self.inner.discoveries.load(Ordering::SeqCst)
    }

    /// Sets what the devices report from now on (unlisted devices: idle).
    pub fn set_telemetry(&self, telemetry: TelemetryFile) {
        *lock(&self.inner.telemetry) = telemetry;
    }

    /// Replaces the simulated machine, e.g. after a MIG reconfiguration. Creation numbers are
    /// kept, so an instance created afterwards still gets a UUID never seen before.
    pub fn set_inventory(&self, inventory: Inventory) {
        *lock(&self.inner.inventory) = inventory;
    }

    /// The simulated GPU a MIG change is for, refused as the driver would: unknown, lost, or
    /// not in MIG mode.
    fn mig_gpu<'i>(
        &self,
        inventory: &'i mut Inventory,
        uuid: &DeviceUuid,
        call: &str,
    ) -> Result<&'i mut Gpu, MigChangeError> {
        if lock(&self.inner.lost).contains(uuid.as_str()) {
            return Err(MigChangeError::Failed {
                call: call.into(),
                reason: format!("GPU {uuid} is lost (fell off the bus)"),
            });
        }
        let gpu = inventory
            .gpus
            .iter_mut()
            .find(|g| g.uuid == *uuid)
            .ok_or_else(|| {
                MigChangeError::NotFound(format!(
                    "no GPU {uuid} on this machine; rediscover and use a listed GPU"
                ))
            })?;
        if !gpu.mig.current {
            return Err(MigChangeError::Refused(format!(
                "GPU {uuid} is not in MIG mode; enable MIG on it (nvidia-smi -i {} -mig 1) \
                 before creating or destroying MIG instances",
                gpu.index
            )));
        }
        Ok(gpu)
    }

    /// Checks that `uuid` names a whole simulated GPU that answers, refused as the fake NVML
    /// refuses: a lost GPU fails, a MIG device is not supported, anything else is not found.
    fn compute_mode_gpu(&self, uuid: &DeviceUuid, call: &str) -> Result<(), ComputeModeError> {
        if lock(&self.inner.lost).contains(uuid.as_str()) {
            return Err(ComputeModeError::Failed {
                call: call.into(),
                reason: format!("GPU {uuid} is lost (fell off the bus)"),
            });
        }
        let inventory = lock(&self.inner.inventory);
        if inventory.gpus.iter().any(|g| g.uuid == *uuid) {
            return Ok(());
        }
        if inventory
            .gpus
            .iter()
            .any(|g| g.mig_devices.iter().any(|m| m.uuid == *uuid))
        {
            return Err(ComputeModeError::Refused(format!(
                "{call}: {uuid} is a MIG device; the compute mode is a whole GPU's"
            )));
        }
        Err(ComputeModeError::NotFound(format!(
            "no GPU {uuid} on this machine; rediscover and use a listed GPU"
        )))
    }
}

/// Locks a mutex, recovering the data if a panicking holder poisoned it: every value guarded
/// here stays consistent between statements, so the data is still good.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceSource for SimSource {
    fn discover(&self) -> Result<Discovery, SourceError> {
        self.inner.discoveries.fetch_add(1, Ordering::SeqCst);
        let mut inventory = lock(&self.inner.inventory).clone();
        let lost_uuids = lock(&self.inner.lost).clone();
        let lost: Vec<LostGpu> = inventory
            .gpus
            .iter()
            .filter(|g| lost_uuids.contains(g.uuid.as_str()))
            .map(|g| LostGpu {
                index: g.index,
                reason: "GPU is lost (fell off the bus)".into(),
            })
            .collect();
        let gone: BTreeSet<u32> = lost.iter().map(|l| l.index).collect();
        inventory.gpus.retain(|g| !gone.contains(&g.index));
        inventory
            .topology
            .links
            .retain(|l| !gone.contains(&l.from) && !gone.contains(&l.to));
        Ok(Discovery { inventory, lost })
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<DeviceEvent>, SourceError> {
        match lock(&self.inner.events).recv_timeout(timeout) {
            Ok(e) => Ok(Some(e)),
            Err(_) => Ok(None),
        }
    }

    fn responds(&self, gpu_uuid: &str) -> bool {
        !lock(&self.inner.lost).contains(gpu_uuid)
    }

    fn sample(&self, uuid: &DeviceUuid) -> Result<Readings, SourceError> {
        let query = |reason: String| SourceError::Query {
            call: "sample".into(),
            reason,
        };
        let (device, memory_mib, kind) = {
            let inventory = lock(&self.inner.inventory);
            let (gpu, memory_mib, kind) = inventory
                .gpus
                .iter()
                .find_map(|g| {
                    if g.uuid == *uuid {
                        let kind = Answering::Gpu {
                            mig_mode: g.mig.current,
                        };
                        return Some((g, g.memory_mib, kind));
                    }
                    let m = g.mig_devices.iter().find(|m| m.uuid == *uuid)?;
                    let kind = Answering::MigDevice { gpm: g.has_gpm() };
                    Some((g, m.memory_mib, kind))
                })
                .ok_or_else(|| query(format!("no device {uuid} on this machine")))?;
            if lock(&self.inner.lost).contains(gpu.uuid.as_str()) {
                return Err(query(format!(
                    "GPU {} is lost (fell off the bus)",
                    gpu.uuid
                )));
            }
            let telemetry = lock(&self.inner.telemetry);
            let device = telemetry.devices.get(uuid.as_str()).cloned();
            (device.unwrap_or_default(), memory_mib, kind)
        };
        // A stalled device stalls only its caller, as a driver call does: no lock is held.
        std::thread::sleep(Duration::from_millis(device.stall_ms));
        if device.fail {
            return Err(query(format!("device {uuid} does not answer")));
        }
        Ok(device.readings(memory_mib * 1024 * 1024, kind))
    }

    fn create_mig(&self, req: &MigRequest) -> Result<MigDevice, MigChangeError> {
        let mut inventory = lock(&self.inner.inventory);
        let gpu = self.mig_gpu(&mut inventory, &req.gpu, "create_mig")?;
        let refused = |rule: String| {
            MigChangeError::Refused(format!(
                "GPU {} refuses MIG instance {} at memory slice {}: {rule}",
                req.gpu, req.profile, req.start
            ))
        };
        let table = instances::table(gpu).ok_or_else(|| {
            refused(format!(
                "no bundled MIG table for {}, so its placement rules are unknown",
                gpu.product_name
            ))
        })?;
        let profile = table.profile(&req.profile).ok_or_else(|| {
            refused(format!(
                "no such profile in table {} (one of {})",
                table.name,
                table.profile_names().join(", ")
            ))
        })?;
        let mut books = lock(&self.inner.books);
        let book = books.entry(req.gpu.clone()).or_default();
        instances::create(table, gpu, book, profile, req.start).map_err(|e| refused(e.to_string()))
    }

    fn destroy_mig(&self, gpu: &DeviceUuid, gpu_instance_id: u32) -> Result<(), MigChangeError> {
        let mut inventory = lock(&self.inner.inventory);
        let found = self.mig_gpu(&mut inventory, gpu, "destroy_mig")?;
        let table = instances::table(found).ok_or_else(|| {
            MigChangeError::Refused(format!(
                "GPU {gpu} ({}) has no bundled MIG table; destroy its MIG instances with nvidia-smi",
                found.product_name
            ))
        })?;
        let mut books = lock(&self.inner.books);
        let book = books.entry(gpu.clone()).or_default();
        if instances::destroy(table, found, book, gpu_instance_id) {
            Ok(())
        } else {
            Err(MigChangeError::NotFound(format!(
                "GPU {gpu} has no GPU instance {gpu_instance_id} (already destroyed?)"
            )))
        }
    }

    fn compute_mode(&self, gpu: &DeviceUuid) -> Result<ComputeMode, ComputeModeError> {
        self.compute_mode_gpu(gpu, "nvmlDeviceGetComputeMode")?;
        let modes = lock(&self.inner.compute_modes);
        Ok(modes.get(gpu).copied().unwrap_or_default())
    }

    fn set_compute_mode(
        &self,
        gpu: &DeviceUuid,
        mode: ComputeMode,
    ) -> Result<(), ComputeModeError> {
        self.compute_mode_gpu(gpu, "nvmlDeviceSetComputeMode")?;
        lock(&self.inner.compute_modes).insert(gpu.clone(), mode);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> (SimSource, Inventory) {
        let inventory = crate::sim::load("dynamic-mig-mixed").unwrap();
        (SimSource::new(inventory.clone()), inventory)
    }

    fn req(gpu: &DeviceUuid, profile: &str, start: u32) -> MigRequest {
        MigRequest {
            gpu: gpu.clone(),
            profile: profile.into(),
            start,
        }
    }

    #[test]
    fn created_instances_are_discovered_as_returned_and_destroyed_ones_are_gone() {
        let (sim, inv) = machine();
        let gpu = &inv.gpus[0].uuid;
        let four = sim.create_mig(&req(gpu, "4g.40gb", 0)).unwrap();
        let three = sim.create_mig(&req(gpu, "3g.40gb", 4)).unwrap();
        assert_eq!((four.gpu_instance_id, three.gpu_instance_id), (1, 2));
        assert_eq!(three.placement.start, 4);
        let found = sim.discover().unwrap().inventory;
        assert_eq!(found.gpus[0].mig_devices, vec![four.clone(), three.clone()]);
        sim.destroy_mig(gpu, four.gpu_instance_id).unwrap();
        let found = sim.discover().unwrap().inventory;
        assert_eq!(found.gpus[0].mig_devices, vec![three]);
        let again = sim.destroy_mig(gpu, four.gpu_instance_id).unwrap_err();
        assert!(matches!(again, MigChangeError::NotFound(_)), "{again}");
    }

    #[test]
    fn refusals_name_the_gpu_the_request_and_the_rule() {
        let (sim, inv) = machine();
        let gpu = &inv.gpus[0].uuid;
        sim.create_mig(&req(gpu, "4g.40gb", 0)).unwrap();
        let overlap = sim.create_mig(&req(gpu, "3g.40gb", 0)).unwrap_err();
        let text = overlap.to_string();
        assert!(matches!(overlap, MigChangeError::Refused(_)), "{text}");
        for part in [gpu.as_str(), "3g.40gb", "memory slice 0", "overlaps"] {
            assert!(text.contains(part), "{text}");
        }
        let other = &inv.gpus[1].uuid;
        sim.create_mig(&req(other, "1g.10gb+me", 0)).unwrap();
        let engines = sim.create_mig(&req(other, "1g.10gb+me", 1)).unwrap_err();
        assert!(engines.to_string().contains("OFA"), "{engines}");
        let start = sim.create_mig(&req(other, "3g.40gb", 2)).unwrap_err();
        assert!(start.to_string().contains("allowed"), "{start}");
        let unknown = sim.create_mig(&req(other, "5g.50gb", 0)).unwrap_err();
        assert!(unknown.to_string().contains("one of"), "{unknown}");
        let l4 = sim
            .create_mig(&req(&inv.gpus[3].uuid, "1g.10gb", 0))
            .unwrap_err();
        assert!(matches!(l4, MigChangeError::Refused(_)), "{l4}");
        assert!(l4.to_string().contains("MIG mode"), "{l4}");
        let nowhere = DeviceUuid::parse("GPU-00000000-0000-0000-0000-000000000000").unwrap();
        let missing = sim.create_mig(&req(&nowhere, "1g.10gb", 0)).unwrap_err();
        assert!(matches!(missing, MigChangeError::NotFound(_)), "{missing}");
    }

    #[test]
    fn compute_modes_start_default_are_kept_per_gpu_and_refused_for_mig_lost_and_unknown() {
        let (sim, inv) = machine();
        let (h100, other) = (&inv.gpus[0].uuid, &inv.gpus[1].uuid);
        assert_eq!(sim.compute_mode(h100).unwrap(), ComputeMode::Default);
        sim.set_compute_mode(h100, ComputeMode::ExclusiveProcess)
            .unwrap();
        assert_eq!(
            sim.compute_mode(h100).unwrap(),
            ComputeMode::ExclusiveProcess
        );
        assert_eq!(sim.compute_mode(other).unwrap(), ComputeMode::Default);
        sim.clone()
            .set_compute_mode(h100, ComputeMode::Prohibited)
            .unwrap();
        assert_eq!(
            sim.compute_mode(h100).unwrap(),
            ComputeMode::Prohibited,
            "clones share the machine"
        );

        let mig = &inv.gpus[2].mig_devices[0].uuid;
        let e = sim.compute_mode(mig).unwrap_err();
        assert!(matches!(e, ComputeModeError::Refused(_)), "{e}");
        let nowhere = DeviceUuid::parse("GPU-00000000-0000-0000-0000-000000000000").unwrap();
        let e = sim
            .set_compute_mode(&nowhere, ComputeMode::Default)
            .unwrap_err();
        assert!(matches!(e, ComputeModeError::NotFound(_)), "{e}");
        sim.set_lost(other, true);
        let e = sim.compute_mode(other).unwrap_err();
        assert!(matches!(e, ComputeModeError::Failed { .. }), "{e}");
        assert!(e.to_string().contains("lost"), "{e}");
    }

    #[test]
    fn compute_modes_read_and_print_in_nvidia_smis_words() {
        let all = [
            (ComputeMode::Default, "Default"),
            (ComputeMode::ExclusiveProcess, "Exclusive_Process"),
            (ComputeMode::Prohibited, "Prohibited"),
        ];
        for (mode, words) in all {
            assert_eq!(mode.to_string(), words);
            let json = serde_json::to_string(&mode).unwrap();
            assert_eq!(json, format!("\"{words}\""));
            assert_eq!(serde_json::from_str::<ComputeMode>(&json).unwrap(), mode);
        }
        assert_eq!(ComputeMode::default(), ComputeMode::Default);
    }

    #[test]
    fn static_instances_count_and_can_be_destroyed_and_recreated_with_a_new_uuid() {
        let (sim, inv) = machine();
        let gpu = &inv.gpus[2];
        let full = sim.create_mig(&req(&gpu.uuid, "1g.10gb", 0)).unwrap_err();
        assert!(full.to_string().contains("overlaps"), "{full}");
        let old = &gpu.mig_devices[0];
        sim.destroy_mig(&gpu.uuid, old.gpu_instance_id).unwrap();
        let new = sim.create_mig(&req(&gpu.uuid, "3g.40gb", 0)).unwrap();
        assert_eq!(new.gpu_instance_id, old.gpu_instance_id);
        assert_eq!(new.placement, old.placement);
        assert_ne!(new.uuid, old.uuid, "a re-created instance is a new device");
        let found = sim.discover().unwrap().inventory;
        assert_eq!(found.gpus[2].mig_devices[0], new);
        assert_eq!(found.gpus[2].mig_devices[1], gpu.mig_devices[1]);
    }
}
