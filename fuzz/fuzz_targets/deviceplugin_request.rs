//! Fuzz target `deviceplugin_request`: the check is `gpuplane::fuzzing::deviceplugin_request`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane::fuzzing::deviceplugin_request(data));
