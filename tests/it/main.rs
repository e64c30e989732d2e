//! The integration tests that need no Kubernetes lab, as one test binary: the product linked
//! once, each former test file a module. They drive the agent, the controller and the webhook
//! through their real interfaces (gRPC over unix sockets, HTTPS, files, podman, the CLI) against
//! the test kit's doubles. Tests of different modules run side by side (the test harness's
//! threads), so none may own a process-wide thing: ports come from `support::free_port`, files
//! from temp dirs. The fake NVML loaded into the process is the exception: it reads its profile
//! from the environment, so `tests/nvml_fake.rs` stays a binary of its own.

#[path = "../support/mod.rs"]
mod support;

#[path = "../support/lab.rs"]
mod lab;

#[cfg(feature = "crashpoints")]
#[path = "../support/crash_node.rs"]
mod crash_node;

mod apiserver_double;
mod architecture;
mod async_blocking;
mod cdi_podman;
mod cdi_specs;
mod cli;
mod controller;
mod crash;
mod crash_dynamic_mig;
mod crash_shares;
mod dcgm_compat;
mod demo;
mod deviceplugin;
mod docs_examples;
mod doctor;
mod dra_core;
mod dra_dynamic_mig;
mod dra_events;
mod dra_grpc;
mod dra_node;
mod dra_restart;
mod dra_shares;
mod explain;
mod fuzz_corpus;
mod gpu_hours;
mod kubelet_authority;
mod ledger_stress;
mod manifests;
mod mps_pods;
mod peer_faults;
mod prometheus_https;
mod proto_names;
mod quantities;
mod restart_stress;
mod security;
mod share_memory;
mod slices;
mod telemetry;
mod webhook;
