//! System-wide queries: driver, NVML and CUDA driver versions, and the driver version a test
//! may put in place of the profile's (`GPUPLANE_FAKE_NVML_DRIVER_VERSION`).

use crate::{entry, put, put_str, state, Ret, UNKNOWN};
use nvml_wrapper_sys::bindings::nvmlReturn_t;
use std::ffi::{c_char, c_int, c_uint};

/// Fake-only: a driver version (`615.20.01`) reported instead of the profile's, everywhere the
/// fake reports one, so a test can run the calls newer drivers add on a bundled profile.
pub(crate) const DRIVER_VERSION_ENV: &str = "GPUPLANE_FAKE_NVML_DRIVER_VERSION";

/// The version [`DRIVER_VERSION_ENV`] names (unset or empty: none), checked as the profile
/// loader checks `driverVersion`: 2 to 4 dot-separated numbers.
pub(crate) fn driver_version_override() -> Result<Option<String>, String> {
    let Some(raw) = std::env::var_os(DRIVER_VERSION_ENV).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let text = raw.to_string_lossy().into_owned();
    let parts: Vec<&str> = text.split('.').collect();
    let numeric = parts
        .iter()
        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    if !numeric || !(2..=4).contains(&parts.len()) {
        return Err(format!(
            "fake NVML: {DRIVER_VERSION_ENV}=`{text}` is not a driver version (2 to 4 \
             dot-separated numbers, e.g. 615.20.01)"
        ));
    }
    Ok(Some(text))
}

/// The branch of a driver version: `615` of `615.20.01`.
pub(crate) fn driver_major(version: &str) -> Option<u32> {
    version.split('.').next()?.parse().ok()
}

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
