//! Fuzz target `opaque_config`: the check is `gpuplane::fuzzing::opaque_config`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane::fuzzing::opaque_config(data));
