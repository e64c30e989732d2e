#!/usr/bin/env python3
"""Writes a one-image OCI image layout as a tar that `ctr images import` takes, with no base
image and no registry: the lab's images (busybox, pause) and the test image of gpuplane itself
(the binary and the shared libraries it links) are made this way, offline.

  oci-image.py OUT.tar --name REF [--entrypoint JSON] [--cmd JSON] [--user U:G] [--env K=V]...
      [--file SRC:DEST]... [--symlink DEST:TARGET]... [--dir DEST]...

One layer; directories of every file are created (0755, /tmp 1777); files keep their mode.
The image config also records the layer's files under the label `dev.gpuplane.files` so a test
can compare the image with the Dockerfile without unpacking it.
"""
import argparse, hashlib, io, json, os, sys, tarfile

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--name", required=True)
p.add_argument("--entrypoint")
p.add_argument("--cmd")
p.add_argument("--user")
p.add_argument("--env", action="append", default=[])
p.add_argument("--file", action="append", default=[])
p.add_argument("--symlink", action="append", default=[])
p.add_argument("--dir", action="append", default=[])
a = p.parse_args()

dirs, entries = set(), []
def parents(path):
    parts = path.strip("/").split("/")[:-1]
    for i in range(1, len(parts) + 1):
        dirs.add("/".join(parts[:i]))
for d in a.dir:
    dirs.add(d.strip("/")); parents(d)
for f in a.file:
    src, dest = f.split(":", 1)
    if not os.path.isfile(src):
        sys.exit(f"oci-image.py: {src} is not a file (for {dest})")
    entries.append(("file", dest.strip("/"), src)); parents(dest)
for s in a.symlink:
    dest, target = s.split(":", 1)
    entries.append(("link", dest.strip("/"), target)); parents(dest)

buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
    for d in sorted(dirs):
        ti = tarfile.TarInfo(d); ti.type = tarfile.DIRTYPE
        ti.mode = 0o1777 if d == "tmp" else 0o755
        t.addfile(ti)
    for kind, dest, x in entries:
        if kind == "file":
            # Symlinks are followed (a library's path is often a link): the image gets the file.
            with open(x, "rb") as fh:
                ti = t.gettarinfo(arcname=dest, fileobj=fh)
                ti.uid = ti.gid = 0; ti.uname = ti.gname = ""; ti.mtime = 0
                t.addfile(ti, fh)
        else:
            ti = tarfile.TarInfo(dest); ti.type = tarfile.SYMTYPE; ti.linkname = x
            t.addfile(ti)
layer = buf.getvalue()

blobs = {}
def blob(data):
    d = hashlib.sha256(data).hexdigest()
    blobs[d] = data
    return {"digest": "sha256:" + d, "size": len(data)}

config = {"Env": a.env or ["PATH=/usr/local/bin:/usr/bin:/bin"],
          "Labels": {"dev.gpuplane.files": json.dumps(sorted("/" + e[1] for e in entries))}}
if a.entrypoint: config["Entrypoint"] = json.loads(a.entrypoint)
if a.cmd: config["Cmd"] = json.loads(a.cmd)
if a.user: config["User"] = a.user
lay = blob(layer)
cfg = blob(json.dumps({"architecture": "amd64", "os": "linux", "config": config,
    "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}}).encode())
man = blob(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": dict(cfg, mediaType="application/vnd.oci.image.config.v1+json"),
    "layers": [dict(lay, mediaType="application/vnd.oci.image.layer.v1.tar")]}).encode())
index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
    "manifests": [dict(man, mediaType="application/vnd.oci.image.manifest.v1+json",
        platform={"architecture": "amd64", "os": "linux"},
        annotations={"io.containerd.image.name": a.name,
                     "org.opencontainers.image.ref.name": a.name.rsplit(":", 1)[-1]})]}

tmp = a.out + ".tmp"
with tarfile.open(tmp, mode="w") as out:
    def add(name, data):
        ti = tarfile.TarInfo(name); ti.size = len(data); out.addfile(ti, io.BytesIO(data))
    for d, data in blobs.items():
        add(f"blobs/sha256/{d}", data)
    add("index.json", json.dumps(index).encode())
    add("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
os.replace(tmp, a.out)
