//! Fuzz target `deviceplugin_request`: the check is `gpuplane_testkit::fuzzing::deviceplugin_request`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane_testkit::fuzzing::deviceplugin_request(data));
