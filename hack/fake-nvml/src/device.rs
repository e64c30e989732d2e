//! Device enumeration and the per-GPU facts: handles, identity, memory, PCI, NUMA, MIG mode.

use crate::state::{with_fake, Dev, Handle};
use crate::{
    entry, fill_chars, put, put_str, Ret, ARGUMENT_VERSION_MISMATCH, INVALID_ARGUMENT, NOT_FOUND,
    NOT_SUPPORTED, UNKNOWN,
};
// NVML brand names in `nvmlBrandType` order: a brand's position is its NVML value.
use gpuplane_model::sim::BRANDS;
use nvml_wrapper_sys::bindings::*;
use std::ffi::{c_char, c_int, c_uint, CStr};

const ARCHITECTURES: &[(&str, u32)] = &[
    ("Kepler", NVML_DEVICE_ARCH_KEPLER),
    ("Maxwell", NVML_DEVICE_ARCH_MAXWELL),
    ("Pascal", NVML_DEVICE_ARCH_PASCAL),
    ("Volta", NVML_DEVICE_ARCH_VOLTA),
    ("Turing", NVML_DEVICE_ARCH_TURING),
    ("Ampere", NVML_DEVICE_ARCH_AMPERE),
    ("Ada", NVML_DEVICE_ARCH_ADA),
    ("Hopper", NVML_DEVICE_ARCH_HOPPER),
    ("Blackwell", NVML_DEVICE_ARCH_BLACKWELL),
];

/// `DDDDDDDD:BB:DD.F` → (domain, bus, device).
pub(crate) fn parse_bus_id(bus_id: &str) -> Option<(u32, u32, u32)> {
    let mut parts = bus_id.split(':');
    let domain = u32::from_str_radix(parts.next()?, 16).ok()?;
    let bus = u32::from_str_radix(parts.next()?, 16).ok()?;
    let device = u32::from_str_radix(parts.next()?.split('.').next()?, 16).ok()?;
    Some((domain, bus, device))
}

/// The PCI record NVML gives for an address.
pub(crate) fn pci_info(bus_id: &str) -> Result<nvmlPciInfo_t, Ret> {
    let (domain, bus, device) = parse_bus_id(bus_id).ok_or(UNKNOWN)?;
    let mut info = nvmlPciInfo_t {
        busIdLegacy: [0; 16],
        domain,
        bus,
        device,
        pciDeviceId: 0x2330_10de,
        pciSubSystemId: 0x16c1_10de,
        busId: [0; 32],
    };
    fill_chars(
        &mut info.busIdLegacy,
        &format!("{domain:04X}:{bus:02X}:{device:02X}.0"),
    );
    fill_chars(&mut info.busId, bus_id);
    Ok(info)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    entry(|| {
        let n = with_fake(|f| Ok(f.inventory.gpus.len() as c_uint))?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(count, n) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        with_fake(|f| f.gpu_at(index).map(|_| ()))?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(device, Handle::Gpu(index).ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        if uuid.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and nvml.h requires a NUL-terminated string.
        let wanted = unsafe { CStr::from_ptr(uuid) }
            .to_str()
            .map_err(|_| INVALID_ARGUMENT)?
            .to_string();
        let handle = with_fake(|f| {
            for (i, g) in f.inventory.gpus.iter().enumerate() {
                let i = i as u32;
                if g.uuid == wanted {
                    f.gpu_at(i)?;
                    return Ok(Handle::Gpu(i));
                }
                if let Some(m) = g.mig_devices.iter().find(|m| m.uuid == wanted) {
                    f.gpu_at(i)?;
                    return Ok(Handle::Mig {
                        gpu: i,
                        gi: m.gpu_instance_id,
                        ci: m.compute_instance_id,
                    });
                }
            }
            Err(NOT_FOUND)
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(device, handle.ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        if bus_id.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and nvml.h requires a NUL-terminated string.
        let wanted = unsafe { CStr::from_ptr(bus_id) }
            .to_str()
            .map_err(|_| INVALID_ARGUMENT)?;
        let wanted = parse_bus_id(wanted).ok_or(INVALID_ARGUMENT)?;
        let index = with_fake(|f| {
            let i = f
                .inventory
                .gpus
                .iter()
                .position(|g| parse_bus_id(&g.pci_bus_id) == Some(wanted))
                .ok_or(NOT_FOUND)?;
            f.gpu_at(i as u32)?;
            Ok(i as u32)
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(device, Handle::Gpu(index).ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let i = with_fake(|f| f.gpu(device).map(|(i, _)| i))?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(index, i) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let m = with_fake(|f| f.gpu(device).map(|(_, g)| g.minor))?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(minor, m) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let text = with_fake(|f| {
            Ok(match f.dev(device)? {
                Dev::Gpu(_, g) => g.uuid.clone(),
                Dev::Mig(_, _, m) => m.uuid.clone(),
            })
        })?;
        // SAFETY: caller's buffer of `length` bytes (nvml.h contract).
        unsafe { put_str(uuid, length, &text) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let text = with_fake(|f| {
            Ok(match f.dev(device)? {
                Dev::Gpu(_, g) => g.product_name.clone(),
                Dev::Mig(_, g, m) => format!("{} MIG {}", g.product_name, m.profile),
            })
        })?;
        // SAFETY: caller's buffer of `length` bytes (nvml.h contract).
        unsafe { put_str(name, length, &text) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| {
            let (_, g) = f.gpu(device)?;
            BRANDS
                .iter()
                .position(|b| *b == g.brand)
                .map(|p| p as nvmlBrandType_t)
                .ok_or(UNKNOWN)
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(brand, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| {
            let (_, g) = f.gpu(device)?;
            Ok(ARCHITECTURES
                .iter()
                .find(|(n, _)| *n == g.architecture)
                .map_or(NVML_DEVICE_ARCH_UNKNOWN, |(_, v)| *v))
        })?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(arch, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    entry(|| {
        let (ma, mi) = with_fake(|f| {
            let (_, g) = f.gpu(device)?;
            let (ma, mi) = g.cuda_compute_capability.split_once('.').ok_or(UNKNOWN)?;
            Ok((
                ma.parse::<c_int>().map_err(|_| UNKNOWN)?,
                mi.parse::<c_int>().map_err(|_| UNKNOWN)?,
            ))
        })?;
        // SAFETY: caller's out-pointers (nvml.h contract).
        unsafe {
            put(major, ma)?;
            put(minor, mi)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    entry(|| {
        // In use: the telemetry file's reading (`telemetry.rs`).
        let (total, used) = crate::telemetry::memory(device)?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe {
            put(
                memory,
                nvmlMemory_t {
                    total,
                    free: total - used,
                    used,
                },
            )
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    entry(|| {
        if memory.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let expected = (std::mem::size_of::<nvmlMemory_v2_t>() | 2 << 24) as c_uint;
        // SAFETY: non-null caller's struct (nvml.h contract); only its version field is read.
        let version = unsafe { (*memory).version };
        if version != expected {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let (total, used) = crate::telemetry::memory(device)?;
        // SAFETY: as above, valid for a write of the whole struct.
        unsafe {
            put(
                memory,
                nvmlMemory_v2_t {
                    version,
                    total,
                    reserved: 0,
                    free: total - used,
                    used,
                },
            )
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let info = with_fake(|f| pci_info(&f.gpu(device)?.1.pci_bus_id))?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(pci, info) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(
    device: nvmlDevice_t,
    node: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let value = with_fake(|f| f.gpu(device)?.1.numa_node.ok_or(NOT_SUPPORTED))?;
        // SAFETY: caller's out-pointer (nvml.h contract).
        unsafe { put(node, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let mode = with_fake(|f| {
            let (i, g) = f.gpu(device)?;
            f.extra(i)?.catalogue.ok_or(NOT_SUPPORTED)?;
            Ok(g.mig.clone())
        })?;
        // SAFETY: caller's out-pointers (nvml.h contract).
        unsafe {
            put(current, c_uint::from(mode.current))?;
            put(pending, c_uint::from(mode.pending))
        }
    })
}
