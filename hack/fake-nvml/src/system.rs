//! System-wide queries: driver, NVML and CUDA driver versions.

use crate::{entry, put, put_str, state, Ret, UNKNOWN};
use nvml_wrapper_sys::bindings::nvmlReturn_t;
use std::ffi::{c_char, c_int, c_uint};

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let text = state::with_fake(|f| Ok(f.inventory.driver_version.clone()))?;
        // SAFETY: `version` is the caller's buffer of `length` bytes (nvml.h contract).
        unsafe { put_str(version, length, &text) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let driver = state::with_fake(|f| Ok(f.inventory.driver_version.clone()))?;
        let text = format!("12.{driver}");
        // SAFETY: `version` is the caller's buffer of `length` bytes (nvml.h contract).
        unsafe { put_str(version, length, &text) }
    })
}

fn cuda_driver_version() -> Result<c_int, Ret> {
    state::with_fake(|f| {
        let (major, minor) = f
            .inventory
            .cuda_driver_version
            .split_once('.')
            .ok_or(UNKNOWN)?;
        let major: c_int = major.parse().map_err(|_| UNKNOWN)?;
        let minor: c_int = minor.parse().map_err(|_| UNKNOWN)?;
        Ok(major * 1000 + minor * 10)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    // SAFETY: `version` is the caller's out-pointer (nvml.h contract).
    entry(|| unsafe { put(version, cuda_driver_version()?) })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    // SAFETY: `version` is the caller's out-pointer (nvml.h contract).
    entry(|| unsafe { put(version, cuda_driver_version()?) })
}
