#!/usr/bin/env bash
# The test "cluster lab" (issue 13, phase 2): one real Kubernetes control plane and node, kept
# up until killed. tests/cluster/mod.rs (ClusterLab) drives it; it grew from phase 1's
# feasibility script (README.md has the why of every step).
#   ./hack/cluster/lab.sh up <workdir>      (root; <workdir> short, e.g. /tmp/gpl-XXXXXX)
#   LAB_NODES=3 ./hack/cluster/lab.sh up <workdir>   (N nodes; default 1)
#   LAB_NODES=0 ./hack/cluster/lab.sh up <workdir>   (the control plane only: no containerd,
#                       no kubelet; nodes are another's to fake, e.g. kwok in
#                       benches/pending_scale.rs; `ready` once the default ServiceAccount exists)
# Starts etcd, kube-apiserver (--authorization-mode=Node,RBAC), kube-controller-manager,
# kube-scheduler and, per node, containerd 2 and a kubelet (node lab-node, node IP 10.213.0.2;
# then lab-node-2 at 10.213.0.3, ...) inside fresh network, mount and PID namespaces (unshare),
# imports the offline images lab.local/busybox:1 and lab.local/pause:1 into every node, and
# then waits. Each node's kubelet and containerd run in a mount namespace of their own in which
# /var/lib/kubelet, /var/run/cdi and /var/lib/gpuplane are that node's directories, so a
# DaemonSet's hostPaths as shipped resolve per node, as on real hosts. All nodes share the
# lab's one network namespace: node IPs on the bridge lab0, each node's pods on a bridge and
# subnet of its own (10.214.<n-1>.0/24), routed to each other; no kube-proxy, so the one
# Service pods need, `kubernetes` (10.0.0.1:443), is a DNAT rule to the API server, and the
# API server reaches webhook Services through their endpoints (--enable-aggregator-routing).
# Files in <workdir> for the driving side:
#   init.pid            host pid of the namespaces' init (PID 1 there): `nsenter --net
#                       --target <pid>` joins the lab's network; SIGKILL to it ends the lab
#   ready               written once node lab-node is Ready
#   failed              written (with the reason) when a start step failed; the script exits
#   pki/admin.kubeconfig  cluster-admin (server https://127.0.0.1:6443, in the lab's netns)
#   pki/ca.crt          the cluster CA
#   kubelet/            node lab-node's /var/lib/kubelet (its kubelet's --root-dir), as seen
#                       from the host: device-plugins/, plugins_registry/, plugins/,
#                       pod-resources/
#   cdi/                node lab-node's /var/run/cdi, which its containerd reads CDI specs from
#   gpuplane/           node lab-node's /var/lib/gpuplane
#   mnt.pid             the lab's pid of a process in node lab-node's mount namespace:
#                       `nsenter --mount=/proc/<init>/root/proc/<pid>/ns/mnt` sees the node's
#                       /var/run/cdi and /var/lib/kubelet where a host has them
#                       (nodes/<name>/mnt.pid: the other nodes')
#   nodes/<name>/       the same three (and containerd/) of every further node
#   nodes.txt           one line per node: name, node IP, node dir, containerd socket
#   audit.log           the API server's audit of gpuplane's service accounts' writes
#   log/<component>.log every component's output (kubelet.log, containerd.log: lab-node's;
#                       kubelet-<name>.log, containerd-<name>.log: the others')
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

NODES="${LAB_NODES:-1}"
[[ "$NODES" =~ ^[0-9]$ ]] || { echo "lab.sh: LAB_NODES must be 0..9, not $NODES" >&2; exit 2; }
node_name() { if (($1 == 1)); then echo lab-node; else echo "lab-node-$1"; fi; }
node_ip() { echo "10.213.0.$(($1 + 1))"; }
# lab-node keeps the work dir's top-level layout, which single-node tests know.
node_dir() { if (($1 == 1)); then echo "$W"; else echo "$W/nodes/$(node_name "$1")"; fi; }
node_log() { if (($1 == 1)); then echo "$2"; else echo "$2-$(node_name "$1")"; fi; }
NODE_IP="$(node_ip 1)"
ip link set lo up
ip link add lab0 type bridge  # no dummy driver in this kernel; a lone bridge serves
# The first node's IP is the API server's advertised address, nodes or not.
for i in $(seq "$((NODES > 0 ? NODES : 1))"); do ip addr add "$(node_ip "$i")/24" dev lab0; done
ip link set lab0 up
ip route add default dev lab0
# Pods of different nodes reach each other through this namespace.
echo 1 >/proc/sys/net/ipv4/ip_forward

for d in /run /var/lib /var/log; do mount -n -t tmpfs -o mode=755 tmpfs "$d"; done  # -n: no utab in the host's /run/mount
# The kubelets tune these global sysctls at start; each gets a plain file holding the value the
# kubelet wants already, so no kubelet writes it: concurrent kubelets truncating and rewriting one
# plain file let another read "" and fail with "Failed to start ContainerManager: strconv.Atoi".
mkdir -p "$W/sysctl"
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
  kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  s="${kv%%=*}"; f="$W/sysctl/${s//\//_}"; echo "${kv#*=}" >"$f"; mount -n --bind "$f" "/proc/sys/$s"
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
for i in $(seq "$NODES"); do
  n="$(node_name "$i")"
  cert "$(node_log "$i" kubelet)" "/O=system:nodes/CN=system:node:$n"
  cert "$(node_log "$i" kubelet-serving)" "/CN=$n" "IP:127.0.0.1,IP:$(node_ip "$i"),DNS:$n"
done
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
for n in admin kcm scheduler; do kubeconfig $n; done
for i in $(seq "$NODES"); do kubeconfig "$(node_log "$i" kubelet)"; done
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
  --enable-aggregator-routing=true \
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
if ((NODES == 0)); then
  : >"$W/nodes.txt"
  log "lab up (control plane only), ${SECONDS}s in the namespaces"
  echo "$SECONDS" >"$W/ready"
  while true; do sleep 3600; done
fi

# ---------------------------------------------------------------- the nodes
# No kube-proxy: pods reach the Service `kubernetes` (10.0.0.1:443, where in-cluster clients
# dial) through this one rule, as kube-proxy's would; nothing else needs a ClusterIP here.
for chain in PREROUTING OUTPUT; do
  iptables -t nat -A "$chain" -d 10.0.0.1/32 -p tcp --dport 443 -j DNAT --to-destination "$NODE_IP:6443"
done

# The offline images, made once for all nodes (oci-image.py: no base image, no registry).
mkdir -p "$W/image"
printf 'root:x:0:0:root:/:/bin/sh\n' >"$W/image/passwd"
printf 'root:x:0:\n' >"$W/image/group"
bb=(--env PATH=/bin --file /bin/busybox:/bin/busybox --file "$W/image/passwd:/etc/passwd"
    --file "$W/image/group:/etc/group" --dir /tmp --dir /proc --dir /sys --dir /dev)
for a in sh sleep echo cat ls env hostname ip id true wget; do bb+=(--symlink "/bin/$a:busybox"); done
python3 "$here/oci-image.py" "$W/image/busybox.tar" --name lab.local/busybox:1 --cmd '["/bin/sh"]' "${bb[@]}"
python3 "$here/oci-image.py" "$W/image/pause.tar" --name lab.local/pause:1 --cmd '["/bin/sleep", "2147483647"]' "${bb[@]}"
export PATH="$B:$PATH"

healthz_port() { if (($1 == 1)); then echo 10248; else echo $((20246 + $1)); fi; }
declare -A holder kubelet_pid
# A node's own mount namespace: a process kept in it, entered by everything the node runs.
node_ns() { local i="$1"; shift; nsenter --mount --target "${holder[$i]}" -- "$@"; }

up_node() { # i: containerd (with the images) and the kubelet config of node i
  local i="$1" n d ip
  n="$(node_name "$i")"; d="$(node_dir "$i")"; ip="$(node_ip "$i")"
  mkdir -p "$d"/{kubelet,cdi,gpuplane,containerd/root,containerd/state,pod-logs,cni}
  unshare --mount --propagation private sleep infinity &
  holder[$i]=$!
  until [[ "$(readlink "/proc/${holder[$i]}/ns/mnt")" != "$(readlink /proc/self/ns/mnt)" ]]; do sleep 0.02; done
  echo "${holder[$i]}" >"$d/mnt.pid"
  # Fresh /run and /var/lib, with the node's directories where a host has them; shared
  # propagation as systemd sets it up on a real host (mountPropagation: HostToContainer, as
  # the DaemonSet asks for the driver root, needs it). The lab's namespace keeps it from the
  # host.
  node_ns "$i" sh -ec "
    mount -n -t tmpfs -o mode=755 tmpfs /run; mkdir -p /run/cdi; mount -n --bind '$d/cdi' /run/cdi
    mount -n -t tmpfs -o mode=755 tmpfs /var/lib; mkdir -p /var/lib/kubelet /var/lib/gpuplane
    mount -n --bind '$d/kubelet' /var/lib/kubelet; mount -n --bind '$d/gpuplane' /var/lib/gpuplane
    mount -n --make-rshared /"
  # Its own cgroup root (lab-node's is the lab's, as before).
  local cgroot="$LAB_CGROUP"
  if ((i > 1)); then
    cgroot="$LAB_CGROUP/$n"
    for h in /sys/fs/cgroup/*/; do mkdir -p "$h${cgroot#/}"; done
    if [[ -f "/sys/fs/cgroup/cpuset$LAB_CGROUP/cpuset.cpus" ]]; then
      cat "/sys/fs/cgroup/cpuset$LAB_CGROUP/cpuset.cpus" >"/sys/fs/cgroup/cpuset$cgroot/cpuset.cpus"
      cat "/sys/fs/cgroup/cpuset$LAB_CGROUP/cpuset.mems" >"/sys/fs/cgroup/cpuset$cgroot/cpuset.mems"
    fi
  fi
  # containerd 2, CRI plugin with CDI (always on in 2.x), runc from Debian.
  cat >"$d/containerd.toml" <<CONF
version = 3
root = "$d/containerd/root"
state = "$d/containerd/state"
[grpc]
  address = "$d/containerd/containerd.sock"
[ttrpc]
  address = "$d/containerd/containerd.sock.ttrpc"
[debug]
  address = "$d/containerd/debug.sock"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "lab.local/pause:1"
[plugins."io.containerd.cri.v1.runtime"]
  cdi_spec_dirs = ["/var/run/cdi"]
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
    conf_dir = "$d/cni"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
CONF
  cat >"$d/cni/10-lab.conflist" <<CONF
{"cniVersion": "1.0.0", "name": "lab", "plugins": [
  {"type": "bridge", "bridge": "lab-br$((i - 1))", "isDefaultGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.214.$((i - 1)).0/24"}]], "dataDir": "$d/cni-ipam"}},
  {"type": "loopback"}]}
CONF
  start "$(node_log "$i" containerd)" nsenter --mount --target "${holder[$i]}" -- "$B/containerd" --config "$d/containerd.toml" --log-level info
  local ctr=("$B/ctr" --address "$d/containerd/containerd.sock" -n k8s.io)
  wait_for "$(node_log "$i" containerd)" 60 "${ctr[@]}" version
  for img in busybox pause; do "${ctr[@]}" images import "$W/image/$img.tar" 2>&1 | sed "s/^/  $n: /"; done
  cat >"$d/kubelet.yaml" <<CONF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: "$cgroot"
failSwapOn: false
containerRuntimeEndpoint: "unix://$d/containerd/containerd.sock"
podLogsDir: "$d/pod-logs"
address: "$ip"
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $(healthz_port "$i")
tlsCertFile: "$P/$(node_log "$i" kubelet-serving).crt"
tlsPrivateKeyFile: "$P/$(node_log "$i" kubelet-serving).key"
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
CONF
  echo "$n $ip $d $d/containerd/containerd.sock" >>"$W/nodes.txt.tmp"
}

start_kubelet() { # i
  local i="$1"
  # nsenter itself, not the node_ns function: a function sent to the background is a subshell,
  # and its pid is not the kubelet's (a restart must signal the kubelet). nsenter execs it.
  nsenter --mount --target "${holder[$i]}" -- "$B/kubelet" --config="$(node_dir "$i")/kubelet.yaml" \
    --kubeconfig="$P/$(node_log "$i" kubelet).kubeconfig" --root-dir=/var/lib/kubelet \
    --hostname-override="$(node_name "$i")" --node-ip="$(node_ip "$i")" --v=2 \
    >>"$W/log/$(node_log "$i" kubelet).log" 2>&1 &
  kubelet_pid[$i]=$!
  log "started $(node_log "$i" kubelet) (pid ${kubelet_pid[$i]})"
}

rm -f "$W/nodes.txt.tmp"
for i in $(seq "$NODES"); do up_node "$i"; done
mv "$W/nodes.txt.tmp" "$W/nodes.txt"
for i in $(seq "$NODES"); do start_kubelet "$i"; done
for i in $(seq "$NODES"); do
  wait_for "$(node_log "$i" kubelet) healthz" 120 curl -sf "http://127.0.0.1:$(healthz_port "$i")/healthz"
done
for i in $(seq "$NODES"); do
  n="$(node_name "$i")"
  wait_for "node $n Ready" 180 sh -c "\"$B/kubectl\" get node $n -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
done
log "lab up ($NODES node(s)), ${SECONDS}s in the namespaces"
echo "$SECONDS" >"$W/ready"

# Wait until killed; serve restart requests meanwhile: ctl/restart-kubelet (lab-node),
# ctl/restart-kubelet-<name> (the others); done: ctl/<same>-restarted-<count>.
declare -A restarts
while true; do
  for i in $(seq "$NODES"); do
    k="$(node_log "$i" kubelet)"
    [[ -e "$W/ctl/restart-$k" ]] || continue
    log "restarting $k"
    kill -TERM "${kubelet_pid[$i]}" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "${kubelet_pid[$i]}" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "${kubelet_pid[$i]}" 2>/dev/null || true
    wait "${kubelet_pid[$i]}" 2>/dev/null || true
    rm -f "$W/ctl/restart-$k"
    start_kubelet "$i"
    wait_for "$k healthz" 120 curl -sf "http://127.0.0.1:$(healthz_port "$i")/healthz" || { rm -f "$W/failed"; continue; }
    restarts[$i]=$((${restarts[$i]:-0} + 1))
    if ((i == 1)); then touch "$W/ctl/kubelet-restarted-${restarts[$i]}"; else touch "$W/ctl/$k-restarted-${restarts[$i]}"; fi
  done
  sleep 0.2
done
