//! Fuzz target `agent_config`: the check is `gpuplane_testkit::fuzzing::agent_config`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane_testkit::fuzzing::agent_config(data));
