# One image for every face of gpuplane: `gpuplane node` (DaemonSet) and `gpuplane controller`
# (Deployment). Build: docker build -t gpuplane:0.1.0 .
#
# Stage 1: build. protox compiles the kubelet protos in Rust, so no protoc is needed.
FROM rust:1.88-bookworm AS build
WORKDIR /src
COPY . .
# Cache mounts keep the registry and target dir between builds; the binary is copied out of
# the cached target dir, which is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked -p gpuplane --bin gpuplane --no-default-features \
    && install -D -m 0755 target/dist/gpuplane /out/gpuplane

# Stage 2: run. distroless/cc has glibc and libgcc (all the binary links against) and nothing
# else: no shell, no package manager. NVML (libnvidia-ml.so.1) is not in the image: the node
# agent loads the host driver's copy at run time (--nvml-lib, from the mounted driver root).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/gpuplane /usr/bin/gpuplane
# Non-root by default: the controller runs as this user (65532). The node agent's DaemonSet
# overrides it with runAsUser: 0, because the kubelet's socket directories and /var/run/cdi
# on the host are root-owned and the agent must create sockets and files there.
USER 65532:65532
ENTRYPOINT ["/usr/bin/gpuplane"]
