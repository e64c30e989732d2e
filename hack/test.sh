#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs
# formatting, lints (-D warnings) and every test in the workspace.
#   ./hack/test.sh            everything CI runs
#   ./hack/test.sh --extended that, then every fuzz target for FUZZ_SECONDS each (default 60;
#                             hack/fuzz.sh, which installs nightly and cargo-fuzz if missing)
set -euo pipefail
cd "$(dirname "$0")/.."

extended=false
for arg in "$@"; do
  case "$arg" in
    --extended) extended=true ;;
    *) echo "hack/test.sh: unknown argument $arg (use --extended)" >&2; exit 2 ;;
  esac
done

need_apt=()
# The CDI tests run containers with podman + runc from a busybox-static image; the lab's
# Prometheus 2.42 for the host-process labs (busy GPU-hours, the dashboard's queries) is Debian's
# package; hack/cluster/build.sh builds Prometheus 3 (with Kubernetes discovery) for the deployed one.
for pkg in podman runc busybox-static prometheus; do
  # Installed, not merely known (a removed package keeps "deinstall ok config-files").
  [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" == "install ok installed" ]] || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "hack/test.sh: installing ${need_apt[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "hack/test.sh: missing ${need_apt[*]} and cannot install them (need root and apt-get); container tests will be skipped" >&2
  fi
fi

rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt clippy

# One profile for every build below so they share artifacts; Cargo.toml says why it is lean.
profile=(--profile ci)
target_dir="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target_dir"
echo "== disk: $(df -h --output=avail "$target_dir" | tail -1 | tr -d ' ') free for $target_dir (a cold run needs about 3 GB here)"

echo "== rustfmt"
cargo fmt --all -- --check
# What the tests build in: `gpuplane demo` (tests/it/demo.rs) and the node agent's crash points.
test_features="gpuplane/crashpoints,gpuplane/demo"
echo "== the image's binary (the Dockerfile's build: --no-default-features) for the test image"
# Built first and copied aside: the build below puts the tests' binary (demo, crash points)
# back at target/ci/gpuplane, and the deployment tests put this one into their image.
cargo build "${profile[@]}" -p gpuplane --bin gpuplane --no-default-features
install -D -m 0755 "$target_dir/ci/gpuplane" "$target_dir/ci/image/gpuplane"
echo "== build the tests (three integration binaries: tests/it, tests/lab, tests/nvml_fake.rs)"
# Not --all-targets: the benches would link six more binaries that no test runs; clippy below
# still type-checks them. The fake NVML and MPS are built by the tests that load them.
suite_build=(--workspace --tests --features "$test_features")
cargo build "${profile[@]}" "${suite_build[@]}"
# The tests ask cargo for their stand-ins (fake NVML, fake MPS) with this very build, which it
# finds fresh: built once (tests/support/mod.rs, `built_artifact`).
export GPUPLANE_SUITE_BUILD="${suite_build[*]}"
echo "== clippy -D warnings"
cargo clippy "${profile[@]}" --workspace --all-targets -- -D warnings
# The shipped build leaves the demo and the crash points out; the tests need them.
cargo clippy "${profile[@]}" --workspace --all-targets --features "$test_features" -- -D warnings
# The image's build: no demo, no test doubles (Dockerfile: --no-default-features).
cargo clippy "${profile[@]}" -p gpuplane --bin gpuplane --no-default-features -- -D warnings
echo "== rustdoc -D warnings (intra-doc links resolve across the crate edges)"
RUSTDOCFLAGS="-D warnings" cargo doc "${profile[@]}" --workspace --no-deps
echo "== cluster binaries and helm for tests/lab (hack/cluster/build.sh: about 38 min cold, cached after)"
if cluster_out="$(./hack/cluster/build.sh)"; then
  export GPUPLANE_CLUSTER_BIN="$(sed -n 's/^GPUPLANE_CLUSTER_BIN=//p' <<<"$cluster_out")"
  echo "GPUPLANE_CLUSTER_BIN=$GPUPLANE_CLUSTER_BIN"
elif [[ -n "${CI:-}" ]]; then
  echo "hack/test.sh: hack/cluster/build.sh failed (CI is set: the real-cluster tests may not skip)" >&2
  exit 1
else
  echo "hack/test.sh: hack/cluster/build.sh failed; the real-cluster tests will skip" >&2
fi
echo "== tests"
cargo test "${profile[@]}" --workspace --features "$test_features"
if $extended; then
  echo "== fuzz (extended)"
  ./hack/fuzz.sh
fi
