//! Fuzz target `sim_profile`: the check is `gpuplane_testkit::fuzzing::sim_profile`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane_testkit::fuzzing::sim_profile(data));
