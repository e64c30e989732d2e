//! Fuzz target `opaque_config`: the check is `gpuplane_testkit::fuzzing::opaque_config`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane_testkit::fuzzing::opaque_config(data));
