"""The .deb's copyright paragraphs for the Python packages bundled in the venv.

Owns: turning each distribution installed in the staged venv's site-packages (every one but
gpu-agent itself) into a DEP-5 Files paragraph: its files, the copyright lines of its licence
texts (else its declared authors), its declared licence, and the licence texts its wheel ships
(verbatim, but for the Apache License 2.0, which Debian keeps in /usr/share/common-licenses and
which packaging/deb/copyright's own Apache-2.0 paragraph points to). Run by scripts/build-deb,
which appends the output to packaging/deb/copyright; the list follows whatever pip resolved.
Must not: install, change or judge anything; a dependency without a licence text fails the
build, so that a new one is looked at before it ships.

Usage: python3 bundled_copyright.py ROOT SITE_PACKAGES  (SITE_PACKAGES inside ROOT)
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

OWN = "gpu-agent"
LICENCE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE)", re.IGNORECASE)
# A licence text's own copyright line, not the template lines of the Apache appendix.
COPYRIGHT_LINE = re.compile(r"^\s*(Copyright\s*(\([cC]\)|©)|Copyright \d{4}).*$", re.MULTILINE)
APACHE_2 = ("Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE")


def licence_name(meta) -> str:
    """The declared licence, as a DEP-5 short name (no spaces): the SPDX expression where the
    metadata has one (PEP 639), else the License field, else the classifier."""
    expression = meta.get("License-Expression")
    if expression:
        return re.sub(r"\s+(AND|OR|WITH)\s+", lambda m: f" {m.group(1).lower()} ", expression)
    declared = (meta.get("License") or "").strip()
    if not declared or "\n" in declared:
        classifiers = [c.rsplit("::", 1)[-1].strip() for c in meta.get_all("Classifier") or []
                       if c.startswith("License ::")]
        declared = classifiers[0] if classifiers else "see-below"
    return re.sub(r"\s+", "-", re.sub(r"\s+License$", "", declared))


def header_comment(path: Path) -> str:
    """The leading comment block of a module, where packages without a licence file (pynvml)
    keep their licence, without the comment signs and the box drawn around it."""
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("#"):
            break
        lines.append(re.sub(r"\s*#+$", "", line.lstrip("#")))
    return "\n".join(lines).strip("\n")


def licence_texts(dist, site: Path) -> list[str]:
    files = [site / f for f in dist.files or [] if LICENCE_FILE.match(f.name)]
    texts = [f.read_text(errors="replace").strip("\n") for f in files if f.is_file()]
    if not texts:
        modules = [site / f for f in dist.files or [] if f.suffix == ".py"
                   and len(f.parts) == 1]
        texts = [t for t in (header_comment(m) for m in modules) if "Copyright" in t]
    return texts


def paths(dist, root: Path, site: Path) -> list[str]:
    """What the distribution installed in site-packages, as patterns relative to ROOT."""
    tops = set()
    for f in dist.files or []:
        if f.parts[0] == ".." or "__pycache__" in f.parts:
            continue  # the console scripts in bin/ (gpu-agent's only), the byte-code
        top = f.parts[0]
        tops.add(top if len(f.parts) == 1 else f"{top}/*")
    prefix = site.relative_to(root)
    return [f"{prefix}/{top}" for top in sorted(tops)]


def field(text: str) -> str:
    """Text as a DEP-5 continuation: each line indented by one space, empty lines as ' .'."""
    return "\n".join(f" {line}" if line.strip() else " ." for line in text.splitlines())


def paragraph(dist, root: Path, site: Path) -> str:
    meta = dist.metadata
    name, version = meta["Name"], dist.version
    texts = licence_texts(dist, site)
    if not texts:
        sys.exit(f"bundled_copyright: {name} {version} ships no licence text; look at it")
    holders = sorted({m.group(0).strip() for t in texts for m in COPYRIGHT_LINE.finditer(t)})
    if not holders:
        authors = meta.get("Author") or meta.get("Author-email") or meta.get("Maintainer") \
            or meta.get("Maintainer-email") or f"the authors of {name}"
        holders = [f"{authors} (the authors {name} declares; its licence names none)"]
    shipped = []
    for text in texts:
        if all(marker in text for marker in APACHE_2):
            shipped.append("The Apache License, Version 2.0: on Debian systems in\n"
                           "/usr/share/common-licenses/Apache-2.0.")
        else:
            shipped.append(text)
    files = paths(dist, root, site)
    return "\n".join([
        "Files: " + "\n       ".join(files),
        "Copyright: " + "\n           ".join(holders),
        f"License: {licence_name(meta)}",
        field("\n\n".join(shipped)),
        f"Comment: {name} {version}, installed from its wheel into gpu-agent's venv.",
    ])


def main(root: str, site: str) -> None:
    root_path, site_path = Path(root), Path(site)
    dists = sorted((d for d in metadata.distributions(path=[site]) if d.metadata["Name"] != OWN),
                   key=lambda d: d.metadata["Name"].lower())
    print("\n\n".join(paragraph(d, root_path, site_path) for d in dists))


if __name__ == "__main__":
    main(*sys.argv[1:])
