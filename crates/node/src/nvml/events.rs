//! Critical Xid events: one NVML event set for the source's lifetime, every answering GPU
//! registered in it, and the mapping from an event back to GPU and MIG device UUIDs.

use super::call::describe;
use super::raw::{self, RawEventSet};
use crate::inventory::{DeviceUuid, Inventory};
use crate::source::{DeviceEvent, SourceError};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::nvmlEventTypeXidCriticalError;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const XID: u64 = nvmlEventTypeXidCriticalError as u64;
/// Xid 79: the GPU has fallen off the bus.
const XID_GPU_LOST: u64 = 79;
/// NVML's "not attributable to a MIG instance" value for instance ids in event data.
const NO_INSTANCE: u32 = u32::MAX;

pub(super) struct Events {
    /// `None` when the driver offers no event sets; `next_event` then just waits out its timeout.
    set: Option<RawEventSet>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// GPUs (by UUID) currently registered in the set.
    registered: BTreeSet<String>,
    /// Device handle address → GPU UUID, so events name GPUs that no longer answer.
    handles: HashMap<usize, String>,
    /// GPU index → UUID, from the last time the GPU answered.
    by_index: BTreeMap<u32, String>,
    /// (GPU UUID, GPU instance, compute instance) → MIG UUID, from the last discovery.
    mig: HashMap<(String, u32, u32), String>,
}

impl Events {
    pub(super) fn new(nvml: &Nvml) -> Events {
        let set = match raw::create_event_set(nvml) {
            Ok(set) => Some(set),
            Err(e) => {
                tracing::warn!(error = %describe(&e), "NVML event set unavailable; Xid events will not be reported");
                None
            }
        };
        Events {
            set,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update below leaves the maps consistent between statements.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Frees the set; called once, from `NvmlSource::drop`, while NVML is still initialised.
    pub(super) fn free(&mut self, nvml: &Nvml) {
        if let Some(set) = self.set.take() {
            raw::free_event_set(nvml, &set);
        }
    }

    /// Registers GPU `index` for critical Xids unless it already is.
    pub(super) fn ensure_registered(
        &self,
        nvml: &Nvml,
        index: u32,
        device: &Device<'_>,
        uuid: &str,
    ) {
        let Some(set) = &self.set else { return };
        {
            let mut state = self.state();
            state.by_index.insert(index, uuid.to_string());
            state
                .handles
                .insert(raw::handle(device).expose_provenance(), uuid.to_string());
            if state.registered.contains(uuid) {
                return;
            }
        }
        let supported = match raw::supported_event_types(nvml, device) {
            Ok(types) => types,
            Err(e) => {
                tracing::debug!(gpu = uuid, error = %describe(&e), "nvmlDeviceGetSupportedEventTypes failed; trying Xid anyway");
                XID
            }
        };
        if supported & XID == 0 {
            tracing::debug!(gpu = uuid, "GPU does not report Xid events");
            return;
        }
        match raw::register_events(nvml, device, XID, set) {
            Ok(()) => {
                self.state().registered.insert(uuid.to_string());
            }
            Err(e) => {
                tracing::warn!(gpu = uuid, error = %describe(&e), "could not register for Xid events")
            }
        }
    }

    /// Forgets the registration of a GPU that stopped answering, so it is registered again when
    /// it comes back.
    pub(super) fn forget_index(&self, index: u32) {
        let mut state = self.state();
        if let Some(uuid) = state.by_index.get(&index).cloned() {
            state.registered.remove(&uuid);
        }
    }

    /// Remembers which MIG device each (GPU, GPU instance, compute instance) is.
    pub(super) fn remember_mig_devices(&self, inventory: &Inventory) {
        let mig = inventory
            .gpus
            .iter()
            .flat_map(|g| &g.mig_devices)
            .map(|m| {
                (
                    (
                        m.parent_uuid.to_string(),
                        m.gpu_instance_id,
                        m.compute_instance_id,
                    ),
                    m.uuid.to_string(),
                )
            })
            .collect();
        self.state().mig = mig;
    }

    /// Waits up to `timeout` for a critical Xid.
    pub(super) fn next(
        &self,
        nvml: &Nvml,
        timeout: Duration,
    ) -> Result<Option<DeviceEvent>, SourceError> {
        let Some(set) = &self.set else {
            std::thread::sleep(timeout);
            return Ok(None);
        };
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = u32::try_from(left.as_millis()).unwrap_or(u32::MAX);
            let event = match raw::wait(nvml, set, ms) {
                Ok(e) => e,
                Err(NvmlError::Timeout) => return Ok(None),
                Err(e) => {
                    return Err(SourceError::Query {
                        call: "nvmlEventSetWait_v2".into(),
                        reason: describe(&e),
                    })
                }
            };
            if event.event_type & XID != 0 {
                if let Some(e) = self.xid(nvml, event) {
                    return Ok(Some(e));
                }
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    fn xid(&self, nvml: &Nvml, event: raw::RawEvent) -> Option<DeviceEvent> {
        let known = self.state().handles.get(&event.device).cloned();
        let gpu_uuid = match known {
            Some(uuid) => uuid,
            None => match raw::device_at(nvml, event.device).uuid() {
                Ok(uuid) => uuid,
                Err(e) => {
                    tracing::warn!(xid = event.data, error = %describe(&e), "Xid from a device that cannot be named; dropped");
                    return None;
                }
            },
        };
        if event.data == XID_GPU_LOST {
            self.state().registered.remove(&gpu_uuid);
        }
        let mig_uuid =
            if event.gpu_instance_id != NO_INSTANCE && event.compute_instance_id != NO_INSTANCE {
                self.mig_uuid(
                    nvml,
                    &gpu_uuid,
                    event.gpu_instance_id,
                    event.compute_instance_id,
                )
            } else {
                None
            };
        let gpu_uuid = match DeviceUuid::parse(gpu_uuid) {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(xid = event.data, error = %e, "Xid from a device whose UUID is refused; dropped");
                return None;
            }
        };
        // A MIG UUID that does not parse leaves the Xid on the whole GPU, the safe side.
        let mig_uuid = mig_uuid.and_then(|m| {
            DeviceUuid::parse(m)
                .inspect_err(|e| tracing::warn!(xid = event.data, error = %e, "Xid attributed to a MIG device whose UUID is refused; marking the GPU"))
                .ok()
        });
        Some(DeviceEvent::Xid {
            gpu_uuid,
            mig_uuid,
            xid: event.data,
        })
    }

    /// The MIG device with these instance ids: asked live, else from the last discovery.
    fn mig_uuid(&self, nvml: &Nvml, gpu_uuid: &str, gi: u32, ci: u32) -> Option<String> {
        let live = || -> Option<String> {
            let parent = nvml.device_by_uuid(gpu_uuid).ok()?;
            let slots = parent.mig_device_count().ok()?;
            (0..slots).find_map(|slot| {
                let mig = parent.mig_device_by_index(slot).ok()?;
                let ids = (
                    raw::gpu_instance_id(nvml, &mig).ok()?,
                    raw::compute_instance_id(nvml, &mig).ok()?,
                );
                if ids == (gi, ci) {
                    mig.uuid().ok()
                } else {
                    None
                }
            })
        };
        live().or_else(|| {
            self.state()
                .mig
                .get(&(gpu_uuid.to_string(), gi, ci))
                .cloned()
        })
    }
}
