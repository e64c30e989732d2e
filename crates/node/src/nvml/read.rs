//! Reading one GPU, its MIG devices and its NVLinks, and wiring the answered GPUs together.

use super::call::{describe, instance_profiles, Call, CallError};
use super::naming;
use super::raw;
use super::table;
use crate::inventory::{
    DeviceUuid, Gpu, IdError, Link, MigDevice, MigMode, MigProfile, PathLevel, Placement, Topology,
};
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProfileInfo;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU as NVLINK_GPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH as NVLINK_SWITCH,
    NVML_DEVICE_MIG_ENABLE, NVML_NVLINK_MAX_LINKS,
};

/// An identity NVML answered that gpuplane does not accept (a UUID or MIG profile name that
/// does not parse): a failure of GPU `index`, naming the value and the rule it breaks.
fn refused(call: &'static str, index: u32, e: IdError) -> CallError {
    CallError {
        call,
        reason: format!("GPU {index}: NVML answered an {e}"),
    }
}

/// The far end of one active NVLink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LinkEnd {
    /// A GPU (or another PCI device) with this normalized bus id.
    Peer(String),
    /// An NVSwitch.
    Switch,
}

/// One GPU as read, with its NVLinks (needed for topology, not part of `Gpu`).
pub(super) struct GpuRead<'n> {
    pub device: Device<'n>,
    pub gpu: Gpu,
    pub links: Vec<LinkEnd>,
}

/// Reads GPU `index` completely; any failing call fails the GPU.
pub(super) fn gpu<'n>(nvml: &'n Nvml, index: u32) -> Result<GpuRead<'n>, CallError> {
    let device = nvml
        .device_by_index(index)
        .call("nvmlDeviceGetHandleByIndex_v2")?;
    let uuid = device.uuid().call("nvmlDeviceGetUUID")?;
    let uuid = DeviceUuid::parse(uuid).map_err(|e| refused("nvmlDeviceGetUUID", index, e))?;
    let minor = device.minor_number().call("nvmlDeviceGetMinorNumber")?;
    let product_name = device.name().call("nvmlDeviceGetName")?;
    let brand = match device.brand() {
        Ok(b) => format!("{b:?}"),
        Err(NvmlError::UnexpectedVariant(_)) => "Unknown".to_string(),
        Err(e) => return Err(e).call("nvmlDeviceGetBrand"),
    };
    let architecture = match device.architecture() {
        Ok(a) => a.to_string(),
        Err(NvmlError::UnexpectedVariant(_) | NvmlError::NotSupported) => "Unknown".to_string(),
        Err(e) => return Err(e).call("nvmlDeviceGetArchitecture"),
    };
    let cc = device
        .cuda_compute_capability()
        .call("nvmlDeviceGetCudaComputeCapability")?;
    let total_bytes = device
        .memory_info()
        .call("nvmlDeviceGetMemoryInfo_v2")?
        .total;
    let pci = device.pci_info().call("nvmlDeviceGetPciInfo_v3")?;
    let pci_bus_id = naming::normalize_bus_id(&pci.bus_id)
        .unwrap_or_else(|| format!("{:08X}:{:02X}:{:02X}.0", pci.domain, pci.bus, pci.device));
    let numa_node = match device.numa_node_id() {
        Ok(n) => Some(n),
        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => None,
        Err(e) => return Err(e).call("nvmlDeviceGetNumaNodeId"),
    };
    let mig = match device.mig_mode() {
        Ok(m) => MigMode {
            current: m.current == NVML_DEVICE_MIG_ENABLE,
            pending: m.pending == NVML_DEVICE_MIG_ENABLE,
            capable: true,
            table: table::matching(nvml, &device, index, &product_name, total_bytes),
            dynamic: false,
        },
        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => MigMode::default(),
        Err(e) => return Err(e).call("nvmlDeviceGetMigMode"),
    };
    let mig_devices = if mig.current {
        mig_devices(nvml, &device, index, &uuid, total_bytes)?
    } else {
        Vec::new()
    };
    let links = nvlinks(nvml, &device)?;
    let gpu = Gpu {
        index,
        minor,
        uuid,
        product_name,
        brand,
        architecture,
        cuda_compute_capability: format!("{}.{}", cc.major, cc.minor),
        memory_mib: total_bytes >> 20,
        pci_bus_id,
        numa_node,
        mig,
        mig_devices,
    };
    Ok(GpuRead { device, gpu, links })
}

/// The MIG devices of a GPU with MIG on, ordered by (GPU instance, compute instance).
pub(super) fn mig_devices(
    nvml: &Nvml,
    parent: &Device<'_>,
    index: u32,
    parent_uuid: &DeviceUuid,
    total_bytes: u64,
) -> Result<Vec<MigDevice>, CallError> {
    let slots = parent
        .mig_device_count()
        .call("nvmlDeviceGetMaxMigDeviceCount")?;
    let mut profiles: Option<Vec<(u32, ProfileInfo)>> = None;
    let mut out = Vec::new();
    for slot in 0..slots {
        let mig = match parent.mig_device_by_index(slot) {
            Ok(m) => m,
            Err(NvmlError::NotFound) => continue,
            Err(e) => return Err(e).call("nvmlDeviceGetMigDeviceHandleByIndex"),
        };
        let uuid = mig.uuid().call("nvmlDeviceGetUUID")?;
        let uuid = DeviceUuid::parse(uuid).map_err(|e| refused("nvmlDeviceGetUUID", index, e))?;
        let gpu_instance_id =
            raw::gpu_instance_id(nvml, &mig).call("nvmlDeviceGetGpuInstanceId")?;
        let compute_instance_id =
            raw::compute_instance_id(nvml, &mig).call("nvmlDeviceGetComputeInstanceId")?;
        let attrs = mig.attributes().call("nvmlDeviceGetAttributes_v2")?;
        let info = raw::gpu_instance_by_id(nvml, parent, gpu_instance_id)
            .and_then(|gi| raw::gpu_instance_info(nvml, &gi))
            .call("nvmlDeviceGetGpuInstanceById/nvmlGpuInstanceGetInfo")?;
        if profiles.is_none() {
            profiles = Some(instance_profiles(parent)?);
        }
        let (profile_index, profile) = profiles
            .iter()
            .flatten()
            .find(|(_, p)| p.id == info.profileId)
            .ok_or_else(|| CallError {
                call: "nvmlDeviceGetGpuInstanceProfileInfo",
                reason: format!(
                    "MIG device {uuid}: GPU instance {gpu_instance_id} has profile id {}, which no \
                     NVML_GPU_INSTANCE_PROFILE_* index reports",
                    info.profileId
                ),
            })?;
        let profile_name = naming::mig_profile_name(
            *profile_index,
            profile.slice_count,
            attrs.compute_instance_slice_count,
            profile.memory_size_mb,
            total_bytes,
        );
        out.push(MigDevice {
            uuid,
            parent_uuid: parent_uuid.clone(),
            profile: MigProfile::parse(profile_name)
                .map_err(|e| refused("nvmlDeviceGetGpuInstanceProfileInfo", index, e))?,
            gpu_instance_id,
            compute_instance_id,
            gpu_slices: attrs.gpu_instance_slice_count,
            placement: Placement {
                start: info.placement.start,
                size: info.placement.size,
            },
            memory_mib: attrs.memory_size_mb,
            multiprocessors: attrs.multiprocessor_count,
            copy_engines: attrs.shared_copy_engine_count,
            decoders: attrs.shared_decoder_count,
            encoders: attrs.shared_encoder_count,
            jpeg_engines: attrs.shared_jpeg_count,
            ofa_engines: attrs.shared_ofa_count,
        });
    }
    out.sort_by_key(|m| (m.gpu_instance_id, m.compute_instance_id));
    Ok(out)
}

/// The active NVLinks of a GPU. Unsupported or invalid links count as absent; only a lost GPU
/// fails the read.
fn nvlinks(nvml: &Nvml, device: &Device<'_>) -> Result<Vec<LinkEnd>, CallError> {
    let mut out = Vec::new();
    for l in 0..NVML_NVLINK_MAX_LINKS {
        let link = device.link_wrapper_for(l);
        match link.is_active() {
            Ok(true) => {}
            Ok(false) => continue,
            Err(NvmlError::GpuLost) => {
                return Err(NvmlError::GpuLost).call("nvmlDeviceGetNvLinkState")
            }
            Err(_) => continue,
        }
        let kind = match raw::nvlink_remote_type(nvml, device, l) {
            Ok(k) => Some(k),
            Err(NvmlError::GpuLost) => {
                return Err(NvmlError::GpuLost).call("nvmlDeviceGetNvLinkRemoteDeviceType")
            }
            Err(_) => None,
        };
        if kind == Some(NVLINK_SWITCH) {
            out.push(LinkEnd::Switch);
            continue;
        }
        let remote = match link.remote_pci_info() {
            Ok(p) => naming::normalize_bus_id(&p.bus_id),
            Err(NvmlError::GpuLost) => {
                return Err(NvmlError::GpuLost).call("nvmlDeviceGetNvLinkRemotePciInfo_v2")
            }
            Err(_) => None,
        };
        // A GPU, or a device of unknown type whose address later matches a GPU.
        if let (Some(bus), None | Some(NVLINK_GPU)) = (remote, kind) {
            out.push(LinkEnd::Peer(bus));
        }
    }
    Ok(out)
}

fn path_level(level: TopologyLevel) -> PathLevel {
    match level {
        TopologyLevel::Internal => PathLevel::SameBoard,
        TopologyLevel::Single => PathLevel::SingleSwitch,
        TopologyLevel::Multiple => PathLevel::MultipleSwitches,
        TopologyLevel::HostBridge => PathLevel::HostBridge,
        TopologyLevel::Node => PathLevel::NumaNode,
        TopologyLevel::System => PathLevel::System,
    }
}

/// Links among the GPUs that answered, one per pair, ordered by `(from, to)`.
pub(super) fn topology(nvml: &Nvml, gpus: &[GpuRead<'_>]) -> Topology {
    let switch_links =
        |g: &GpuRead<'_>| g.links.iter().filter(|l| **l == LinkEnd::Switch).count() as u32;
    let direct = |g: &GpuRead<'_>, peer: &GpuRead<'_>| {
        g.links
            .iter()
            .filter(|l| matches!(l, LinkEnd::Peer(bus) if *bus == peer.gpu.pci_bus_id))
            .count() as u32
    };
    let nvswitch = gpus.iter().any(|g| switch_links(g) > 0);
    let mut links = Vec::new();
    for (i, a) in gpus.iter().enumerate() {
        for b in &gpus[i + 1..] {
            let level = match nvml
                .device_by_index(b.gpu.index)
                .and_then(|other| a.device.topology_common_ancestor(other))
            {
                Ok(level) => path_level(level),
                Err(e) => {
                    tracing::warn!(
                        from = a.gpu.index,
                        to = b.gpu.index,
                        error = %describe(&e),
                        "nvmlDeviceGetTopologyCommonAncestor failed; guessing the path from NUMA nodes"
                    );
                    match (a.gpu.numa_node, b.gpu.numa_node) {
                        (Some(x), Some(y)) if x == y => PathLevel::NumaNode,
                        _ => PathLevel::System,
                    }
                }
            };
            let (sa, sb) = (switch_links(a), switch_links(b));
            let fabric = if sa > 0 && sb > 0 { sa.min(sb) } else { 0 };
            let nvlinks = direct(a, b).max(direct(b, a)) + fabric;
            links.push(Link {
                from: a.gpu.index,
                to: b.gpu.index,
                nvlinks,
                level,
            });
        }
    }
    links.sort_by_key(|l| (l.from, l.to));
    Topology { nvswitch, links }
}
