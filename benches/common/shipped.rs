//! Which `gpuplane` binary a memory benchmark runs. Most of an idle process's RSS is the
//! binary's own pages, so the figure that counts is the shipped binary's: the `dist` profile
//! the Dockerfile builds (`cargo build --profile dist -p gpuplane --bin gpuplane
//! --no-default-features`), named by `GPUPLANE_SHIPPED_BIN=target/dist/gpuplane`. Without it,
//! the bench profile's binary is measured.

/// The binary's path, and which one it is (printed beside the figures).
pub fn binary() -> (String, &'static str) {
    match std::env::var("GPUPLANE_SHIPPED_BIN") {
        Ok(path) => (path, "the shipped (GPUPLANE_SHIPPED_BIN)"),
        Err(_) => (
            env!("CARGO_BIN_EXE_gpuplane").to_string(),
            "the bench profile's",
        ),
    }
}
