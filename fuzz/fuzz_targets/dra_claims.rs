//! Fuzz target `dra_claims`: the check is `gpuplane_testkit::fuzzing::dra_claims`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane_testkit::fuzzing::dra_claims(data));
