//! Fuzz target `checkpoint`: the check is `gpuplane_testkit::fuzzing::checkpoint_file`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane_testkit::fuzzing::checkpoint_file(data));
