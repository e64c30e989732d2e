//! Fuzz target `admission_review`: the check is `gpuplane_testkit::fuzzing::admission_review`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane_testkit::fuzzing::admission_review(data));
