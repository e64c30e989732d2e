//! Wiring: PCIe common ancestors and NVLinks (direct to a peer GPU, or to an NVSwitch).

use crate::device::pci_info;
use crate::state::{with_fake, Fake, LinkEnd};
use crate::{entry, put, Ret, INVALID_ARGUMENT, NOT_SUPPORTED};
use gpuplane_model::inventory::PathLevel;
use nvml_wrapper_sys::bindings::*;
use std::ffi::c_uint;

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    entry(|| {
        let level = with_fake(|f| {
            let (a, _) = f.gpu(device1)?;
            let (b, _) = f.gpu(device2)?;
            if a == b {
                return Ok(nvmlGpuLevel_enum_NVML_TOPOLOGY_INTERNAL);
            }
            let link = f.inventory.topology.link(a, b).ok_or(NOT_SUPPORTED)?;
            Ok(match link.level {
                PathLevel::SameBoard => nvmlGpuLevel_enum_NVML_TOPOLOGY_INTERNAL,
                PathLevel::SingleSwitch => nvmlGpuLevel_enum_NVML_TOPOLOGY_SINGLE,
                PathLevel::MultipleSwitches => nvmlGpuLevel_enum_NVML_TOPOLOGY_MULTIPLE,
                PathLevel::HostBridge => nvmlGpuLevel_enum_NVML_TOPOLOGY_HOSTBRIDGE,
                PathLevel::NumaNode => nvmlGpuLevel_enum_NVML_TOPOLOGY_NODE,
                PathLevel::System => nvmlGpuLevel_enum_NVML_TOPOLOGY_SYSTEM,
            })
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(path, level) }
    })
}

/// The far end of `link` on `device`: `Ok(None)` for an inactive link.
fn link_end(f: &Fake, device: nvmlDevice_t, link: c_uint) -> Result<Option<LinkEnd>, Ret> {
    let (i, _) = f.gpu(device)?;
    if link >= NVML_NVLINK_MAX_LINKS {
        return Err(INVALID_ARGUMENT);
    }
    let links = &f.extra(i)?.links;
    if links.is_empty() {
        return Err(NOT_SUPPORTED);
    }
    Ok(links.get(link as usize).copied())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    is_active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    entry(|| {
        let end = with_fake(|f| link_end(f, device, link))?;
        let state = if end.is_some() {
            nvmlEnableState_enum_NVML_FEATURE_ENABLED
        } else {
            nvmlEnableState_enum_NVML_FEATURE_DISABLED
        };
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(is_active, state) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let info = with_fake(|f| match link_end(f, device, link)?.ok_or(NOT_SUPPORTED)? {
            LinkEnd::Gpu(peer) => pci_info(
                &f.inventory
                    .gpus
                    .get(peer as usize)
                    .ok_or(INVALID_ARGUMENT)?
                    .pci_bus_id,
            ),
            LinkEnd::Switch(n) => pci_info(&format!("0000FFFF:{n:02X}:00.0")),
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(pci, info) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    device: nvmlDevice_t,
    link: c_uint,
    kind: *mut nvmlIntNvLinkDeviceType_t,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| {
            Ok(match link_end(f, device, link)?.ok_or(NOT_SUPPORTED)? {
                LinkEnd::Gpu(_) => nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU,
                LinkEnd::Switch(_) => nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH,
            })
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(kind, value) }
    })
}
