#!/usr/bin/env bash
# Builds the upstream components of the test "cluster lab" from Go modules, at the versions
# pinned in hack/cluster/*/go.mod (+ go.sum), and caches them outside target/:
#   ${GPUPLANE_CLUSTER_CACHE:-$HOME/.cache/gpuplane-cluster}/<component>-<key>/bin/
# where <key> hashes that component's go.mod, go.sum, the Go version and the build flags, so a
# component is rebuilt only when one of those changes. All binaries are then linked into
#   ${GPUPLANE_CLUSTER_CACHE}/bin-<key of all>/
# whose path is the last line printed (GPUPLANE_CLUSTER_BIN=...).
#   ./hack/cluster/build.sh               everything (kubemark too; helm for tests/lab/helm/,
#                                         kueue for tests/lab/deploy/kueue.rs, prometheus for
#                                         tests/lab/deploy/busy_hours.rs)
#   ./hack/cluster/build.sh etcd kubernetes   only these components
#   ./hack/cluster/build.sh kwok          kwok alone, for benches/pending_scale.rs: not in the
#                                         default set, so the tests' bin-<key> (and CI's cache)
#                                         stay as they are; it gets a bin-<key> of its own
#   ./hack/cluster/build.sh --check       build and install nothing: print the line when all
#                                         is cached, else exit 3 (tests/cluster uses this)
# As root it also installs the Debian packages the lab runs with (runc, CNI plugins,
# iptables, busybox-static for the test image) when missing.
# Disk: Go's build cache for these builds (several GB) lives in the cache dir only while they
# run, and a component's entries for older keys are removed once its new one is built; only
# the binaries stay (about 700 MB).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${GPUPLANE_CLUSTER_CACHE:-$HOME/.cache/gpuplane-cluster}"
check=0
if [[ "${1:-}" == --check ]]; then check=1; shift; fi
mkdir -p "$cache"

# Debian packages: runc for containerd's shim, CNI plugins (loopback at least), iptables
# for the kubelet, busybox-static for the lab's test image.
need=()
command -v runc >/dev/null || need+=(runc)
[[ -x /usr/lib/cni/loopback ]] || need+=(containernetworking-plugins)
command -v iptables >/dev/null || need+=(iptables)
[[ -x /bin/busybox ]] || need+=(busybox-static)
if ((${#need[@]})); then
  if ((check)); then
    echo "build.sh: missing Debian packages: ${need[*]}" >&2; exit 3
  elif ((EUID == 0)); then
    echo "build.sh: apt-get install ${need[*]}" >&2
    apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 ||
      { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
  else
    echo "build.sh: missing Debian packages (not root, not installing): ${need[*]}" >&2
  fi
fi

export GOFLAGS=-mod=mod CGO_ENABLED=0
# A private build cache, removed on exit: a rebuild happens only when a pin changes, and then
# little of an old cache would apply.
export GOCACHE="$cache/go-build.$$"
trap 'rm -rf "$GOCACHE"' EXIT
gover="$(go env GOVERSION)"

# component -> binaries (go.mod tool packages are built all at once).
declare -A bins=(
  [etcd]="etcd"
  [kubernetes]="kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kubemark"
  [containerd]="containerd containerd-shim-runc-v2 ctr"
  [cri-tools]="crictl"
  [helm]="helm"
  [kwok]="kwok"
  [kueue]="kueue kueue-config"
  [prometheus]="prometheus"
)
components=("$@")
# The default set is what the tests need; kwok (the scale bench only) is built when named.
((${#components[@]})) || components=(etcd kubernetes containerd cri-tools helm kueue prometheus)

# Version stamps: Kubernetes components report (and compare) their version, so stamp the
# release they are built from, as upstream's build does.
k8s_ldflags() {
  local v
  v="$(cd "$here/kubernetes" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
  local minor="${v#v1.}"; minor="${minor%%.*}"
  local p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    printf -- ' -X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean -X %s.buildDate=1970-01-01T00:00:00Z' \
      "$p" "$v" "$p" "$p" "$minor" "$p" "$p"
  done
}
ctrd_ldflags() {
  local v
  v="$(cd "$here/containerd" && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)"
  printf -- ' -X github.com/containerd/containerd/v2/version.Version=%s' "$v"
}

# Helm reports its version, and renders and lints for a Kubernetes version (`.Capabilities.KubeVersion`,
# checked against a chart's kubeVersion) that defaults to v1.20 unless stamped: stamp both as
# helm's Makefile does (the Kubernetes minor of its client-go, major + 1 as client-go is v0.x).
helm_ldflags() {
  local v kv minor
  v="$(cd "$here/helm" && go list -m -f '{{.Version}}' helm.sh/helm/v3)"
  kv="$(cd "$here/helm" && go list -m -f '{{.Version}}' k8s.io/client-go)"
  minor="${kv#v0.}"; minor="${minor%%.*}"
  printf -- ' -X helm.sh/helm/v3/internal/version.version=%s -X helm.sh/helm/v3/internal/version.gitTreeState=clean' "$v"
  local p
  for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    printf -- ' -X %s.k8sVersionMajor=1 -X %s.k8sVersionMinor=%s' "$p" "$p" "$minor"
  done
}

# Kueue reports its version in its log and metrics; stamp it as Kueue's Makefile does.
kueue_ldflags() {
  local v
  v="$(cd "$here/kueue" && go list -m -f '{{.Version}}' sigs.k8s.io/kueue)"
  printf -- " -X sigs.k8s.io/kueue/pkg/version.GitVersion=%s -X sigs.k8s.io/kueue/pkg/version.BuildDate=1970-01-01T00:00:00Z" "$v"
}

# Prometheus reports its version (build_info, /api/v1/status/buildinfo); stamp it as its
# promu build does. Its Go module v0.3MM.P is Prometheus 3.MM.P.
prometheus_ldflags() {
  local v n
  v="$(cd "$here/prometheus" && go list -m -f '{{.Version}}' github.com/prometheus/prometheus)"
  n="${v#v0.}"
  printf -- ' -X github.com/prometheus/common/version.Version=%s.%s.%s -X github.com/prometheus/common/version.Branch=HEAD' \
    "$((${n%%.*} / 100))" "$((${n%%.*} % 100))" "${n#*.}"
}

all_keys=""
for c in "${components[@]}"; do
  [[ -n "${bins[$c]:-}" ]] || { echo "build.sh: unknown component $c" >&2; exit 2; }
  dir="$here/$c"
  ldflags="-s -w"
  case "$c" in
    kubernetes) ldflags+="$(k8s_ldflags)" ;;
    containerd) ldflags+="$(ctrd_ldflags)" ;;
    helm) ldflags+="$(helm_ldflags)" ;;
    kueue) ldflags+="$(kueue_ldflags)" ;;
    prometheus) ldflags+="$(prometheus_ldflags)" ;;
  esac
  key="$(cat "$dir/go.mod" "$dir/go.sum" <(echo "$gover $ldflags") | sha256sum | cut -c1-12)"
  out="$cache/$c-$key/bin"
  all_keys+="$c-$key "
  missing=0
  for b in ${bins[$c]}; do [[ -x "$out/$b" ]] || missing=1; done
  if ((missing && check)); then
    echo "build.sh: $c not built (run ./hack/cluster/build.sh)" >&2; exit 3
  elif ((missing)); then
    start=$SECONDS
    tmp="$cache/$c-$key/tmp.$$"
    rm -rf "$tmp" && mkdir -p "$tmp"
    (cd "$dir" && go build -trimpath -ldflags="$ldflags" -o "$tmp/" tool)
    # etcd's main package is go.etcd.io/etcd/server/v3, so its binary is named server (or v3).
    if [[ "$c" == etcd ]]; then mv "$tmp/server" "$tmp/etcd" 2>/dev/null || mv "$tmp/v3" "$tmp/etcd"; fi
    # Kueue is installed from its own manifests (config/ of the module the binary came from:
    # what its release's manifests.yaml is built from), so they travel with the binary.
    if [[ "$c" == kueue ]]; then
      cp -r "$(cd "$dir" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)/config" "$tmp/kueue-config"
      chmod -R u+w "$tmp/kueue-config"
    fi
    rm -rf "$out" && mv "$tmp" "$out"
    # Older builds of this component (other keys) are dead weight now.
    for old in "$cache/$c"-*; do
      [[ "$old" == "$cache/$c-$key" ]] || rm -rf "$old"
    done
    for b in ${bins[$c]}; do
      echo "built  $c/$b $(du -sh "$out/$b" | cut -f1) in $((SECONDS - start))s: $out/$b"
    done
  else
    for b in ${bins[$c]}; do echo "cached $c/$b: $out/$b"; done
  fi
done

# One directory with every binary, named by the keys of all components in it.
allkey="$(echo "$all_keys" | sha256sum | cut -c1-12)"
bindir="$cache/bin-$allkey"
if [[ ! -d "$bindir" ]]; then
  mkdir -p "$bindir.tmp.$$"
  for k in $all_keys; do ln -sf "$cache/$k/bin/"* "$bindir.tmp.$$/"; done
  mv "$bindir.tmp.$$" "$bindir"
fi
# A component that gained a file under an unchanged key (kueue-config beside kueue) is linked too.
for k in $all_keys; do
  for f in "$cache/$k/bin/"*; do
    [[ -e "$bindir/$(basename "$f")" ]] || ln -s "$f" "$bindir/"
  done
done
# Link dirs whose targets were pruned above point at nothing.
for d in "$cache"/bin-*; do
  [[ "$d" == "$bindir" ]] && continue
  [[ -z "$(find "$d" -maxdepth 1 -xtype l)" ]] || rm -rf "$d"
done
echo "GPUPLANE_CLUSTER_BIN=$bindir"
