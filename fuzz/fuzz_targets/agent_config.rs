//! Fuzz target `agent_config`: the check is `gpuplane::fuzzing::agent_config`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuplane::fuzzing::agent_config(data));
