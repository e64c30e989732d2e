#!/usr/bin/env python3
# Usage (root): poke-from-host.py <pid of the lab namespace init> <lab work dir>; with
# SMOKE_HOLD=N ./smoke.sh the init is the child of unshare. Shows the two ways in for the
# Rust lab harness.
# From OUTSIDE the lab's namespaces: a thread joins the lab's network namespace (setns is
# per thread for CLONE_NEWNET), opens a TCP connection to the apiserver on the lab's
# loopback, and the main thread (host netns) uses that socket; also dials the kubelet's
# device plugin registration socket through the bind-mounted dir.
import ctypes, os, socket, ssl, sys, threading
pid, w = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
out = {}; host_ns = os.readlink("/proc/self/ns/net")
def inside():
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0: raise OSError(ctypes.get_errno(), "setns")
    out["s"] = socket.create_connection(("127.0.0.1", 6443))
t = threading.Thread(target=inside); t.start(); t.join()
ctx = ssl.create_default_context(cafile=f"{w}/pki/ca.crt")
ctx.load_cert_chain(f"{w}/pki/admin.crt", f"{w}/pki/admin.key")
s = ctx.wrap_socket(out["s"], server_hostname="127.0.0.1")
s.sendall(b"GET /api/v1/nodes/lab-node HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
data = b""
while (chunk := s.recv(65536)): data += chunk
print("apiserver from host netns via setns'd socket:", data.split(b"\r\n")[0].decode(), "node json bytes:", len(data))
print("main thread netns still host:", os.readlink("/proc/self/ns/net") == host_ns, host_ns)
u = socket.socket(socket.AF_UNIX); u.connect(f"{w}/device-plugins/kubelet.sock")
print("kubelet device-plugin registration socket reachable from host:", u.fileno() > 0); u.close()
