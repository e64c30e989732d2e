#!/usr/bin/env bash
# Feasibility smoke test of the cluster lab (issue 13, phase 1): starts etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, containerd 2 and one kubelet (node lab-node) from
# the binaries hack/cluster/build.sh made; checks CDI injection through the CRI (crictl),
# runs a hostNetwork busybox pod and a pod on the lab's bridge network (logs, exec), then
# tears everything down. Needs root. About 20 s once the binaries are built.
#   ./hack/cluster/smoke.sh            full kubelet on containerd
#   ./hack/cluster/smoke.sh kubemark   a kubemark hollow node instead of kubelet+containerd
# Isolation: everything runs in fresh network, mount and PID namespaces (unshare), so
#   - traffic stays on the namespace's loopback and a bridge with no ports that only it has;
#   - the kubelet's and containerd's mounts (overlay rootfs, /run/containerd, netns, pod
#     volumes) vanish with the mount namespace;
#   - every process (shims and containers too) is killed when the namespace's init exits;
#   - the kubelet's host sysctls (vm.overcommit_memory, kernel.panic, ...) are shadowed by
#     bind-mounted files, so the machine's values are never changed.
# What outlives the namespaces is cleaned here afterwards: the cgroup subtree
# /sys/fs/cgroup/*/gpuplane-lab-<id> and the temp dir.
# SMOKE_KEEP=1 keeps the temp dir (logs) for reading; SMOKE_WORK=dir chooses it;
# SMOKE_HOLD=N keeps the lab up N seconds after the checks (until $W/hold is removed).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-kubelet}"

if [[ "${1:-}" != --inside ]]; then
  ((EUID == 0)) || { echo "smoke.sh: needs root" >&2; exit 1; }
  bin="${GPUPLANE_CLUSTER_BIN:-$("$here/build.sh" | sed -n 's/^GPUPLANE_CLUSTER_BIN=//p')}"
  # Short path: unix socket paths (containerd's, the kubelet's) are limited to 107 bytes.
  work="${SMOKE_WORK:-$(mktemp -d /tmp/gpl-XXXXXX)}"
  id="$(basename "$work")"
  cg="gpuplane-lab-$id"
  cleanup() {
    # The namespaces are gone once unshare has returned: every lab process is dead (the
    # PID namespace's init took them along) and every lab mount is unmounted.
    for h in /sys/fs/cgroup/*/; do
      [[ -d "$h$cg" ]] && find "$h$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
      [[ ! -d "$h$cg" ]] || { echo "smoke.sh: cgroup $h$cg left behind" >&2; rc=1; }
    done
    if [[ "${SMOKE_KEEP:-0}" == 1 ]]; then echo "smoke.sh: logs in $work/log"; else rm -rf "$work"; fi
    echo "smoke.sh: exit $rc"
  }
  rc=0
  trap 'cleanup; exit $rc' EXIT
  # The kubelet's cgroupRoot must exist in every hierarchy (cgroup v1 here); a v1 cpuset
  # child needs cpus and mems before any task can join it.
  for h in /sys/fs/cgroup/*/; do mkdir -p "$h$cg"; done
  if [[ -f /sys/fs/cgroup/cpuset/cpuset.cpus ]]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$cg/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$cg/cpuset.mems"
  fi
  # unshare's parent ignores SIGTERM and SIGINT, and the namespace's init (PID 1 there)
  # ignores every signal it has no handler for: the one sure stop is SIGKILL to that init,
  # which takes every process of the namespace with it. --kill-child does that should
  # unshare itself die.
  unshare --net --mount --pid --fork --mount-proc --propagation private --kill-child -- \
    env LAB_BIN="$bin" LAB_WORK="$work" LAB_CGROUP="/$cg" LAB_MODE="$mode" "$0" --inside &
  upid=$!
  trap 'rc=143; pkill -KILL -P "$upid"; wait "$upid"; exit' INT TERM
  wait "$upid" || rc=$?
  exit "$rc"
fi

# ---------------------------------------------------------------- inside the namespaces
B="$LAB_BIN" W="$LAB_WORK"
mkdir -p "$W"/{log,pki,etcd,kubelet,pod-logs,cdi,cni,containerd/root,containerd/state,image}
log() { echo "[$(date +%T)] $*"; }
pids=()
start() { # name cmd...: starts in the background, log in $W/log/name.log
  local name="$1"; shift
  "$@" >"$W/log/$name.log" 2>&1 &
  pids+=("$!"); log "started $name (pid $!)"
}
wait_for() { # what timeout-seconds cmd...
  local what="$1" t="$2"; shift 2
  local s=$SECONDS
  until "$@" >/dev/null 2>&1; do
    ((SECONDS - s < t)) || { log "TIMEOUT waiting for $what"; return 1; }
    sleep 0.5
  done
  log "ready: $what after $((SECONDS - s))s"
}
dump() { for f in "$W"/log/*.log; do echo "---- tail $f"; tail -n 25 "$f"; done; }
trap 'rc=$?; ((rc == 0)) || dump; exit $rc' EXIT

# Network: loopback plus an interface of its own (a bridge with no ports) as the node's address (the kubelet refuses a
# loopback node IP). Nothing here can reach outside this namespace.
NODE_IP=10.213.0.2
ip link set lo up
ip link add lab0 type bridge  # no dummy driver in this kernel; a lone bridge serves
ip addr add "$NODE_IP/24" dev lab0
ip link set lab0 up
ip route add default dev lab0

# Mounts private to this namespace. Some paths are hard-coded upstream and ignore every
# root/state dir setting: the kubelet's device plugin socket dir
# /var/lib/kubelet/device-plugins and /var/log/containers, containerd's shim sockets
# /run/containerd/s, runc's state /run/containerd/runc, NRI's /run/nri, the CNI netns dir
# /run/netns and libcni's cache /var/lib/cni. Fresh tmpfs over /run, /var/lib and /var/log
# keeps all of them here (nothing in the lab reads the host's copies).
for d in /run /var/lib /var/log; do mount -n -t tmpfs -o mode=755 tmpfs "$d"; done  # -n: no utab in the host's /run/mount
# The device plugin dir is bind-mounted from the work dir, so that a device plugin outside
# these namespaces reaches the kubelet (and the kubelet it) through unix sockets there.
mkdir -p "$W/device-plugins" /var/lib/kubelet/device-plugins
mount -n --bind "$W/device-plugins" /var/lib/kubelet/device-plugins
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

start kube-apiserver "$B/kube-apiserver" \
  --etcd-servers=http://127.0.0.1:2379 \
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
k version 2>&1 | sed 's/^/  /'
k api-resources --api-group=resource.k8s.io 2>&1 | sed 's/^/  /'
# The default service account (made by the controller manager) must exist before a pod.
wait_for "default serviceaccount" 60 k get serviceaccount default

# ---------------------------------------------------------------- the node
if [[ "$LAB_MODE" == kubemark ]]; then
  # The hollow kubelet makes its root dir under $TMPDIR; its fake CRI serves images too.
  mkdir -p "$W/kubemark"
  start kubemark env TMPDIR="$W/kubemark" "$B/kubemark" --morph=kubelet --name=lab-node \
    --kubeconfig="$P/kubelet.kubeconfig" --cert-dir="$W/kubemark" --use-host-image-service=false \
    --node-labels=gpuplane.lab/hollow=true
  wait_for "node lab-node Ready" 180 sh -c "\"$B/kubectl\" get node lab-node -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
  k get nodes -o wide 2>&1 | sed 's/^/  /'
  cat >"$W/pod.yaml" <<EOF
apiVersion: v1
kind: Pod
metadata: {name: hollow}
spec:
  nodeName: lab-node
  containers: [{name: c, image: lab.local/busybox:1, command: ["sleep", "3600"]}]
EOF
  k apply -f "$W/pod.yaml"
  wait_for "pod hollow Running" 120 sh -c "\"$B/kubectl\" get pod hollow -o jsonpath='{.status.phase}' | grep -qx Running"
  k get pods -o wide 2>&1 | sed 's/^/  /'
  k delete pod hollow --wait=true --timeout=60s
  log "kubemark smoke passed, ${SECONDS}s in the namespaces"
  exit 0
fi

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

# CDI through the CRI, before the kubelet runs (it would collect a sandbox it did not make):
# a spec in the lab's cdi_spec_dirs, a container asking for its device by CDI name. The
# sandbox needs a cgroup_parent under the lab's cgroup, or containerd makes /k8s.io/<id>.
cat >"$W/cdi/lab.yaml" <<EOF
cdiVersion: "0.6.0"
kind: lab.gpuplane/gpu
devices:
- name: "0"
  containerEdits:
    env: ["GPUPLANE_LAB_CDI=device-0"]
EOF
CRICTL=("$B/crictl" --runtime-endpoint "unix://$W/containerd/containerd.sock" --image-endpoint "unix://$W/containerd/containerd.sock" --timeout 30s)
echo '{"metadata": {"name": "cdi", "namespace": "lab", "uid": "cdi-1"}, "log_directory": "'"$W"'/cdi-logs", "linux": {"cgroup_parent": "'"$LAB_CGROUP"'/cdi", "security_context": {"namespace_options": {"network": 2}}}}' >"$W/cdi-pod.json"
echo '{"metadata": {"name": "c"}, "image": {"image": "lab.local/busybox:1"}, "command": ["sh", "-c", "echo $GPUPLANE_LAB_CDI"], "CDI_devices": [{"name": "lab.gpuplane/gpu=0"}], "log_path": "c.log"}' >"$W/cdi-ctr.json"
sb="$("${CRICTL[@]}" runp "$W/cdi-pod.json")"
cid="$("${CRICTL[@]}" create "$sb" "$W/cdi-ctr.json" "$W/cdi-pod.json")"
"${CRICTL[@]}" start "$cid" >/dev/null
cdi_exited() { "${CRICTL[@]}" inspect -o go-template --template '{{.status.state}}' "$cid" | grep -qx CONTAINER_EXITED; }
wait_for "CDI container exited" 30 cdi_exited
cdi_out="$("${CRICTL[@]}" logs "$cid" 2>/dev/null)"
log "CDI: the container printed '$cdi_out'"
"${CRICTL[@]}" rmp -f "$sb" >/dev/null
[[ "$cdi_out" == device-0 ]] || { log "CDI injection FAILED"; exit 1; }

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
start kubelet "$B/kubelet" --config="$W/kubelet.yaml" --kubeconfig="$P/kubelet.kubeconfig" \
  --root-dir="$W/kubelet" --hostname-override=lab-node --node-ip="$NODE_IP" --v=2
wait_for "kubelet healthz" 120 curl -sf http://127.0.0.1:10248/healthz
wait_for "node lab-node Ready" 180 sh -c "\"$B/kubectl\" get node lab-node -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
k get nodes -o wide 2>&1 | sed 's/^/  /'
# Where a device plugin / DRA driver would register (the first is /var/lib/kubelet/device-plugins
# inside, fixed upstream).
ls -l "$W/device-plugins/" "$W/kubelet/plugins_registry/" "$W/kubelet/pod-resources/" 2>&1 | sed 's/^/  /'

cat >"$W/pods.yaml" <<EOF
apiVersion: v1
kind: Pod
metadata: {name: hostnet}
spec:
  hostNetwork: true
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - {name: c, image: lab.local/busybox:1, imagePullPolicy: Never, command: ["sh", "-c", "echo hello-from-hostnet; id; sleep 3600"]}
---
apiVersion: v1
kind: Pod
metadata: {name: podnet}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - {name: c, image: lab.local/busybox:1, imagePullPolicy: Never, command: ["sh", "-c", "echo hello-from-podnet; ip addr; sleep 3600"]}
EOF
k apply -f "$W/pods.yaml"
ok=1
for p in hostnet podnet; do
  if wait_for "pod $p Running" 120 sh -c "\"$B/kubectl\" get pod $p -o jsonpath='{.status.phase}' | grep -qx Running"; then
    k logs "$p" 2>&1 | sed "s/^/  $p log: /"
    k exec "$p" -- echo "exec-in-$p" 2>&1 | sed 's/^/  /'
  else
    ok=0; k describe pod "$p" 2>&1 | tail -n 20 | sed 's/^/  /'
  fi
done
k get pods -o wide 2>&1 | sed 's/^/  /'
k delete pod hostnet podnet --wait=true --timeout=60s 2>&1 | sed 's/^/  /'
((ok)) || exit 1
log "kubelet smoke passed, ${SECONDS}s in the namespaces"
# SMOKE_HOLD=N: keep the lab up to N seconds more, until $W/hold is removed (for poking
# at it from outside: the namespace's init is the child of unshare).
if ((${SMOKE_HOLD:-0} > 0)); then
  touch "$W/hold"; log "holding the lab up to ${SMOKE_HOLD}s: rm $W/hold to end it"
  end=$((SECONDS + SMOKE_HOLD))
  while [[ -e "$W/hold" ]] && ((SECONDS < end)); do sleep 1; done
fi
