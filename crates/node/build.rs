//! Generates the kubelet gRPC bindings (prost messages plus tonic clients and
//! servers) from `proto/` into `OUT_DIR`, using `protox` so that no system
//! `protoc` is needed.
//!
//! Each API is compiled on its own into `OUT_DIR/<module>/` and the single
//! generated file is moved to `OUT_DIR/<module>.rs`, which `crates/node/src/proto.rs`
//! includes. Upstream packages use short, clashing names (`v1beta1` is the
//! device plugin package, `v1` both the DRA health and the pod resources
//! one, and more kubelet APIs reuse those names), so compiling them
//! separately keeps each API's generated code apart.

use std::error::Error;
use std::fs;
use std::path::{Path, PathBuf};

/// (Rust module name under `gpuplane::proto`, proto file under `proto/`).
const APIS: &[(&str, &str)] = &[
    ("deviceplugin_v1beta1", "deviceplugin/v1beta1/api.proto"),
    ("pluginregistration_v1", "pluginregistration/v1/api.proto"),
    ("dra_v1", "dra/v1/api.proto"),
    ("dra_v1beta1", "dra/v1beta1/api.proto"),
    ("dra_health_v1", "dra-health/v1/api.proto"),
    ("dra_health_v1alpha1", "dra-health/v1alpha1/api.proto"),
    ("podresources_v1", "podresources/v1/api.proto"),
];

/// The protos live at the top of the repository (`proto/`), beside the crates; a build script
/// runs in its package's directory.
const PROTO_DIR: &str = "../../proto";

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed={PROTO_DIR}");
    println!("cargo:rerun-if-changed=build.rs");

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    for (module, file) in APIS {
        generate(&out_dir, module, file)?;
    }
    Ok(())
}

fn generate(out_dir: &Path, module: &str, file: &str) -> Result<(), Box<dyn Error>> {
    let fds =
        protox::compile([file], [PROTO_DIR]).map_err(|e| format!("compiling proto/{file}: {e}"))?;

    let dir = out_dir.join(module);
    if dir.exists() {
        fs::remove_dir_all(&dir)?;
    }
    fs::create_dir_all(&dir)?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(&dir)
        .compile_fds(fds)
        .map_err(|e| format!("generating code for proto/{file}: {e}"))?;

    let mut generated = Vec::new();
    for entry in fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "rs") {
            generated.push(path);
        }
    }
    let [single] = generated.as_slice() else {
        return Err(format!("proto/{file}: expected one generated file, got {generated:?}").into());
    };
    fs::rename(single, out_dir.join(format!("{module}.rs")))?;
    fs::remove_dir_all(&dir)?;
    Ok(())
}
