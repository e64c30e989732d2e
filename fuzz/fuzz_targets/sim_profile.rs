//! Fuzz target `sim_profile`: the check is `gpuplane::fuzzing::sim_profile`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane::fuzzing::sim_profile(data));
