//! gpuplane's test kit: doubles of the peers (the kubelet's device manager, plugin watcher and
//! DRA client; an API server with resourceVersions, watches and faults), labs that run the
//! real agent against them, the fuzz properties, and `gpuplane demo`, which tells the whole
//! story on them. A dev-dependency of the tests and benches, and behind the binary's `demo`
//! feature; nothing in the shell or the model depends on it.

#![forbid(unsafe_code)]

pub mod demo;
pub mod doubles;
pub mod fuzzing;
pub mod metrics_text;
