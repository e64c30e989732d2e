//! Fuzz target `cdi_names`: the check is `gpuplane_testkit::fuzzing::cdi_names`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane_testkit::fuzzing::cdi_names(data));
