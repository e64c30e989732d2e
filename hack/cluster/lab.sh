#!/usr/bin/env bash
# The test "cluster lab" (issue 13, phase 2): one real Kubernetes control plane and node, kept
# up until killed. tests/cluster/mod.rs (ClusterLab) drives it; it grew from phase 1's
# feasibility script (README.md has the why of every step).
#   ./hack/cluster/lab.sh up <workdir>      (root; <workdir> short, e.g. /tmp/gpl-XXXXXX)
# Starts etcd, kube-apiserver (--authorization-mode=Node,RBAC), kube-controller-manager,
# kube-scheduler, containerd 2 and a kubelet (node lab-node, node IP 10.213.0.2) inside fresh
# network, mount and PID namespaces (unshare), imports the offline images lab.local/busybox:1
# and lab.local/pause:1, and then waits. Files in <workdir> for the driving side:
#   init.pid            host pid of the namespaces' init (PID 1 there): `nsenter --net
#                       --target <pid>` joins the lab's network; SIGKILL to it ends the lab
#   ready               written once node lab-node is Ready
#   failed              written (with the reason) when a start step failed; the script exits
#   pki/admin.kubeconfig  cluster-admin (server https://127.0.0.1:6443, in the lab's netns)
#   pki/ca.crt          the cluster CA
#   kubelet/            the kubelet's --root-dir, complete as seen from the host:
#                       device-plugins/ (bind-mounted inside on the hard-coded
#                       /var/lib/kubelet/device-plugins), plugins_registry/, plugins/,
#                       pod-resources/
#   cdi/                the directory containerd reads CDI specs from
#   log/<component>.log every component's output
#   ctl/restart-kubelet create it to restart the kubelet (SIGTERM, then a fresh one); the lab
#                       removes it and writes ctl/kubelet-restarted-<n> once the new kubelet's
#                       /healthz answers
# Stop: SIGKILL the init in init.pid (SIGTERM is ignored by it and by unshare). This script then
# returns after removing the lab's cgroups (/sys/fs/cgroup/*/gpuplane-lab-<id>); the caller
# removes <workdir>. Nothing else outlives the namespaces (see README.md, "teardown").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

if [[ "${1:-}" != --inside ]]; then
  [[ "${1:-}" == up && -n "${2:-}" ]] || { echo "usage: lab.sh up <workdir>" >&2; exit 2; }
  ((EUID == 0)) || { echo "lab.sh: needs root" >&2; exit 1; }
  bin="${GPUPLANE_CLUSTER_BIN:-$("$here/build.sh" | sed -n 's/^GPUPLANE_CLUSTER_BIN=//p')}"
  work="$(realpath -m "$2")"
  mkdir -p "$work"
  id="$(basename "$work")"
  cg="gpuplane-lab-$id"
  cleanup() {
    for h in /sys/fs/cgroup/*/; do
      [[ -d "$h$cg" ]] && find "$h$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
      [[ ! -d "$h$cg" ]] || echo "lab.sh: cgroup $h$cg left behind" >&2
    done
  }
  trap cleanup EXIT
  for h in /sys/fs/cgroup/*/; do mkdir -p "$h$cg"; done
  if [[ -f /sys/fs/cgroup/cpuset/cpuset.cpus ]]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$cg/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$cg/cpuset.mems"
  fi
  unshare --net --mount --pid --fork --mount-proc --propagation private --kill-child -- \
    env LAB_BIN="$bin" LAB_WORK="$work" LAB_CGROUP="/$cg" "$0" --inside &
  upid=$!
  # The init is unshare's only child.
  for _ in $(seq 100); do
    init="$(pgrep -P "$upid" || true)"
    [[ -n "$init" ]] && break
    sleep 0.05
  done
  echo "$init" >"$work/init.pid.tmp" && mv "$work/init.pid.tmp" "$work/init.pid"
  trap 'kill -KILL "$init" 2>/dev/null; wait "$upid"; exit 143' INT TERM
  rc=0; wait "$upid" || rc=$?
  exit "$rc"
fi

# ---------------------------------------------------------------- inside the namespaces
B="$LAB_BIN" W="$LAB_WORK"
mkdir -p "$W"/{log,pki,etcd,kubelet/device-plugins,pod-logs,cdi,cni,containerd/root,containerd/state,image,ctl}
log() { echo "[$(date +%T)] $*"; }
start() { # name cmd...: starts in the background, log in $W/log/name.log
  local name="$1"; shift
  "$@" >"$W/log/$name.log" 2>&1 &
  log "started $name (pid $!)"
}
wait_for() { # what timeout-seconds cmd...
  local what="$1" t="$2"; shift 2
  local s=$SECONDS
  until "$@" >/dev/null 2>&1; do
    ((SECONDS - s < t)) || { log "TIMEOUT waiting for $what"; echo "timeout waiting for $what" >"$W/failed"; return 1; }
    sleep 0.5
  done
  log "ready: $what after $((SECONDS - s))s"
}
dump() { for f in "$W"/log/*.log; do echo "---- tail $f"; tail -n 25 "$f"; done; }
trap 'rc=$?; ((rc == 0)) || { [[ -e "$W/failed" ]] || echo "exit $rc" >"$W/failed"; dump; }; exit $rc' EXIT

NODE_IP=10.213.0.2
ip link set lo up
ip link add lab0 type bridge  # no dummy driver in this kernel; a lone bridge serves
ip addr add "$NODE_IP/24" dev lab0
ip link set lab0 up
ip route add default dev lab0

for d in /run /var/lib /var/log; do mount -n -t tmpfs -o mode=755 tmpfs "$d"; done  # -n: no utab in the host's /run/mount
# The device plugin dir is hard-coded upstream; bind-mount the one under the kubelet's
# --root-dir on it, so that the root dir is a complete kubelet root seen from the host too.
mkdir -p /var/lib/kubelet/device-plugins
mount -n --bind "$W/kubelet/device-plugins" /var/lib/kubelet/device-plugins
mkdir -p "$W/sysctl"
for s in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes; do
  f="$W/sysctl/${s//\//_}"; cat "/proc/sys/$s" >"$f"; mount -n --bind "$f" "/proc/sys/$s"
done

# ---------------------------------------------------------------- certificates (openssl)
P="$W/pki"
cd "$P"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj "/CN=gpuplane-lab-ca" 2>/dev/null
cert() { # name subject [san]
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
  local ext="$1.ext"
  { echo "basicConstraints=CA:FALSE"; echo "keyUsage=digitalSignature,keyEncipherment"
    if [[ -n "${3:-}" ]]; then echo "extendedKeyUsage=serverAuth,clientAuth"; echo "subjectAltName=$3"
    else echo "extendedKeyUsage=clientAuth"; fi; } >"$ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days 2 -extfile "$ext" 2>/dev/null
}
cert apiserver "/CN=kube-apiserver" "IP:127.0.0.1,IP:$NODE_IP,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
cert admin "/O=system:masters/CN=lab-admin"
cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
cert kcm "/CN=system:kube-controller-manager"
cert scheduler "/CN=system:kube-scheduler"
cert kubelet "/O=system:nodes/CN=system:node:lab-node"
cert kubelet-serving "/CN=lab-node" "IP:127.0.0.1,IP:$NODE_IP,DNS:lab-node"
openssl genrsa -out sa.key 2048 2>/dev/null && openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
kubeconfig() { # name user
  cat >"$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: lab, cluster: {server: "https://127.0.0.1:6443", certificate-authority: "$P/ca.crt"}}]
users: [{name: $1, user: {client-certificate: "$P/$1.crt", client-key: "$P/$1.key"}}]
contexts: [{name: lab, context: {cluster: lab, user: $1}}]
current-context: lab
EOF
}
for n in admin kcm scheduler kubelet; do kubeconfig $n; done
cd "$W"
export KUBECONFIG="$P/admin.kubeconfig"
k() { "$B/kubectl" "$@"; }
log "certificates made"

# ---------------------------------------------------------------- control plane
start etcd "$B/etcd" --name lab --data-dir "$W/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster lab=http://127.0.0.1:2380 --unsafe-no-fsync --log-level warn
wait_for etcd 60 curl -sf http://127.0.0.1:2379/health

# Audit: every write by gpuplane's service accounts (one event per request), so tests can
# count what the agent and the controller change, e.g. none on an agent restart.
cat >"$W/audit-policy.yaml" <<EOF
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
  userGroups: ["system:serviceaccounts:gpuplane-system"]
- level: None
EOF
start kube-apiserver "$B/kube-apiserver" \
  --etcd-servers=http://127.0.0.1:2379 \
  --audit-policy-file="$W/audit-policy.yaml" --audit-log-path="$W/audit.log" \
  --bind-address=0.0.0.0 --secure-port=6443 --advertise-address="$NODE_IP" \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
  --client-ca-file="$P/ca.crt" \
  --kubelet-client-certificate="$P/apiserver-kubelet-client.crt" --kubelet-client-key="$P/apiserver-kubelet-client.key" \
  --kubelet-preferred-address-types=InternalIP \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-cluster-ip-range=10.0.0.0/24 \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --allow-privileged=true
wait_for kube-apiserver 120 curl -sf --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" https://127.0.0.1:6443/readyz

start kube-controller-manager "$B/kube-controller-manager" \
  --kubeconfig="$P/kcm.kubeconfig" --authentication-kubeconfig="$P/kcm.kubeconfig" --authorization-kubeconfig="$P/kcm.kubeconfig" \
  --bind-address=127.0.0.1 --secure-port=10257 --leader-elect=false \
  --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" --use-service-account-credentials=true \
  --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
  --controllers='*'
start kube-scheduler "$B/kube-scheduler" \
  --kubeconfig="$P/scheduler.kubeconfig" --authentication-kubeconfig="$P/scheduler.kubeconfig" --authorization-kubeconfig="$P/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 --secure-port=10259 --leader-elect=false
wait_for kube-controller-manager 120 curl -skf https://127.0.0.1:10257/healthz
wait_for kube-scheduler 120 curl -skf https://127.0.0.1:10259/healthz
wait_for "default serviceaccount" 60 k get serviceaccount default

# ---------------------------------------------------------------- the node
# containerd 2, CRI plugin with CDI (always on in 2.x; spec dir set here), runc from Debian.
cat >"$W/containerd.toml" <<EOF
version = 3
root = "$W/containerd/root"
state = "$W/containerd/state"
[grpc]
  address = "$W/containerd/containerd.sock"
[ttrpc]
  address = "$W/containerd/containerd.sock.ttrpc"
[debug]
  address = "$W/containerd/debug.sock"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "lab.local/pause:1"
[plugins."io.containerd.cri.v1.runtime"]
  cdi_spec_dirs = ["$W/cdi"]
  # This machine withholds CAP_SYS_RESOURCE, so no process may lower its oom_score_adj:
  # runc fails the sandbox (-998) with "can't get final child's PID from pipe: EOF"
  # ("failed to update /proc/self/oom_score_adj: Permission denied" under runc --debug).
  # Clamp every container's score to containerd's own instead.
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$W/cni"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
EOF
cat >"$W/cni/10-lab.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "lab", "plugins": [
  {"type": "bridge", "bridge": "lab-br0", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.214.0.0/24"}]], "dataDir": "$W/cni-ipam"}},
  {"type": "loopback"}]}
EOF
export PATH="$B:$PATH"
start containerd "$B/containerd" --config "$W/containerd.toml" --log-level info
CTR=("$B/ctr" --address "$W/containerd/containerd.sock" -n k8s.io)
wait_for containerd 60 "${CTR[@]}" version

# Two images made offline from busybox-static: an OCI image layout written by hand.
python3 - "$W/image" <<'EOF'
import hashlib, io, json, os, sys, tarfile
out = sys.argv[1]
def blob(data):
    d = hashlib.sha256(data).hexdigest()
    os.makedirs(f"{out}/blobs/sha256", exist_ok=True)
    open(f"{out}/blobs/sha256/{d}", "wb").write(data)
    return {"digest": "sha256:" + d, "size": len(data)}
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
    for d in ("bin", "etc", "tmp", "proc", "sys", "dev"):
        ti = tarfile.TarInfo(d); ti.type = tarfile.DIRTYPE; ti.mode = 0o1777 if d == "tmp" else 0o755; t.addfile(ti)
    t.add("/bin/busybox", "bin/busybox")
    for a in ("sh", "sleep", "echo", "cat", "ls", "env", "hostname", "ip", "id", "true"):
        ti = tarfile.TarInfo("bin/" + a); ti.type = tarfile.SYMTYPE; ti.linkname = "busybox"; t.addfile(ti)
    for name, body in (("etc/passwd", b"root:x:0:0:root:/:/bin/sh\n"), ("etc/group", b"root:x:0:\n")):
        ti = tarfile.TarInfo(name); ti.size = len(body); t.addfile(ti, io.BytesIO(body))
layer = buf.getvalue()
diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
lay = blob(layer)
manifests = []
for name, cmd in (("lab.local/busybox:1", ["/bin/sh"]), ("lab.local/pause:1", ["/bin/sleep", "2147483647"])):
    cfg = blob(json.dumps({"architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": cmd}, "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode())
    man = blob(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": dict(cfg, mediaType="application/vnd.oci.image.config.v1+json"),
        "layers": [dict(lay, mediaType="application/vnd.oci.image.layer.v1.tar")]}).encode())
    manifests.append(dict(man, mediaType="application/vnd.oci.image.manifest.v1+json",
        platform={"architecture": "amd64", "os": "linux"},
        annotations={"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name.split(":")[1]}))
json.dump({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests}, open(f"{out}/index.json", "w"))
json.dump({"imageLayoutVersion": "1.0.0"}, open(f"{out}/oci-layout", "w"))
EOF
tar -C "$W/image" -cf "$W/images.tar" .
"${CTR[@]}" images import "$W/images.tar" 2>&1 | sed 's/^/  /'
"${CTR[@]}" images ls -q | sed 's/^/  image: /'

cat >"$W/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: "$LAB_CGROUP"
failSwapOn: false
containerRuntimeEndpoint: "unix://$W/containerd/containerd.sock"
podLogsDir: "$W/pod-logs"
address: "$NODE_IP"
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: "$P/kubelet-serving.crt"
tlsPrivateKeyFile: "$P/kubelet-serving.key"
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$P/ca.crt"}
authorization: {mode: Webhook}
evictionHard: {}
evictionSoft: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerNode: true
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
EOF
kubelet_pid=
start_kubelet() {
  "$B/kubelet" --config="$W/kubelet.yaml" --kubeconfig="$P/kubelet.kubeconfig" \
    --root-dir="$W/kubelet" --hostname-override=lab-node --node-ip="$NODE_IP" --v=2 \
    >>"$W/log/kubelet.log" 2>&1 &
  kubelet_pid=$!
  log "started kubelet (pid $kubelet_pid)"
}
start_kubelet
wait_for "kubelet healthz" 120 curl -sf http://127.0.0.1:10248/healthz
wait_for "node lab-node Ready" 180 sh -c "\"$B/kubectl\" get node lab-node -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
log "lab up, ${SECONDS}s in the namespaces"
echo "$SECONDS" >"$W/ready"

# Wait until killed; serve restart requests meanwhile.
restarts=0
while true; do
  if [[ -e "$W/ctl/restart-kubelet" ]]; then
    log "restarting the kubelet"
    kill -TERM "$kubelet_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$kubelet_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$kubelet_pid" 2>/dev/null || true
    wait "$kubelet_pid" 2>/dev/null || true
    rm -f "$W/ctl/restart-kubelet"
    start_kubelet
    wait_for "kubelet healthz" 120 curl -sf http://127.0.0.1:10248/healthz || { rm -f "$W/failed"; continue; }
    restarts=$((restarts + 1))
    touch "$W/ctl/kubelet-restarted-$restarts"
  fi
  sleep 0.2
done
