//! Fuzz target `cdi_names`: the check is `gpuplane::fuzzing::cdi_names`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane::fuzzing::cdi_names(data));
