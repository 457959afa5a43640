"""The two container images of the end-to-end cluster, made here because no registry is reachable:
busybox (Debian's busybox-static and its applet links) for the pods' containers, and pause
(tests/e2e/images/pause.c, built static) for their sandboxes.

Owns: writing each as an OCI image-layout tar (one uncompressed layer) that
`ctr -n k8s.io images import` takes, named by the `io.containerd.image.name` annotation.
Must not talk to containerd itself (tests/e2e/cluster.py imports the tars).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUSYBOX = "localhost/e2e/busybox:1"
# containerd's sandbox image (its CRI config names it; kubelet names none)
PAUSE = "localhost/e2e/pause:1"
BUSYBOX_BINARY = "/bin/busybox"  # Debian's busybox-static


class ImageError(Exception):
    """An image could not be made (a missing tool or file); the message says which."""


def _blob(blobs: dict[str, bytes], data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _layer(files: dict[str, tuple[bytes | str, int]]) -> bytes:
    """An uncompressed tar of `files`: path -> (bytes, mode) for a file, (target, -1) for a
    symlink; directories are added for every parent."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(p).parents[i]) for p in files for i in range(len(Path(p).parts) - 1)}
                      | {"dev", "proc", "sys", "tmp", "etc", "run"})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for path, (content, mode) in sorted(files.items()):
            info = tarfile.TarInfo(path)
            if mode < 0:
                info.type = tarfile.SYMTYPE
                info.linkname = str(content)
                tar.addfile(info)
            else:
                data = content if isinstance(content, bytes) else content.encode()
                info.size = len(data)
                info.mode = mode
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_image(path: str | os.PathLike, name: str, files: dict[str, tuple[bytes | str, int]],
                entrypoint: list[str]) -> str:
    """Write the OCI layout tar of a one-layer image called `name` to `path`; returns path."""
    blobs: dict[str, bytes] = {}
    layer = _layer(files)
    layer_desc = _blob(blobs, layer, "application/vnd.oci.image.layer.v1.tar")
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
    }
    config_desc = _blob(blobs, json.dumps(config, sort_keys=True).encode(),
                        "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": [layer_desc]}
    manifest_desc = _blob(blobs, json.dumps(manifest, sort_keys=True).encode(),
                          "application/vnd.oci.image.manifest.v1+json")
    manifest_desc["annotations"] = {"io.containerd.image.name": name,
                                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [manifest_desc]}
    with tarfile.open(path, "w") as tar:
        def add(member: str, data: bytes) -> None:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add("index.json", json.dumps(index, sort_keys=True).encode())
        for digest, data in sorted(blobs.items()):
            add(f"blobs/sha256/{digest.split(':', 1)[1]}", data)
    return os.fspath(path)


def busybox_image(path: str | os.PathLike) -> str:
    """busybox with a link per applet, `sleep` as its entry point's default."""
    if not os.path.isfile(BUSYBOX_BINARY):
        raise ImageError(f"{BUSYBOX_BINARY} is missing: install Debian's busybox-static")
    binary = Path(BUSYBOX_BINARY).read_bytes()
    applets = subprocess.run([BUSYBOX_BINARY, "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    files: dict[str, tuple[bytes | str, int]] = {"bin/busybox": (binary, 0o755)}
    files.update({f"bin/{a}": ("busybox", -1) for a in applets if a != "busybox"})
    files["etc/passwd"] = ("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n",
                           0o644)
    files["etc/group"] = ("root:x:0:\nnogroup:x:65534:\n", 0o644)
    return write_image(path, BUSYBOX, files, ["/bin/sh"])


def pause_image(path: str | os.PathLike, workdir: str | os.PathLike) -> str:
    """The pause image, its binary compiled static from images/pause.c into workdir."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise ImageError("no C compiler to build the pause binary: install gcc")
    binary = os.path.join(workdir, "pause")
    subprocess.run([cc, "-static", "-O2", "-s", "-o", binary, str(HERE / "images" / "pause.c")],
                   check=True, capture_output=True, text=True)
    return write_image(path, PAUSE, {"pause": (Path(binary).read_bytes(), 0o755)}, ["/pause"])
