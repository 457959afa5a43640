# Sourced by scripts/build-rpm and scripts/build-deb: the version and the source tarball both
# packages are built from, so that the two agree on what "this tree" is.

# The version in agent/__init__.py, the one both packages carry; exits when it cannot be read.
source_version() {
  local version
  version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$1/agent/__init__.py")
  [ -n "$version" ] || { echo "$0: cannot read __version__ from agent/__init__.py" >&2; exit 1; }
  echo "$version"
}

# source_tarball ROOT NAME FILE: FILE (.tar.gz) holds the working tree at ROOT under NAME/: what
# git would commit (tracked files and new ones it does not ignore, as they are on disk), minus
# files deleted on disk. Build output, .venv and dist/ stay out.
source_tarball() {
  git -C "$1" rev-parse --git-dir >/dev/null 2>&1 || { echo "$0: $1 is not a git checkout" >&2; exit 1; }
  (cd "$1" && git ls-files -z --cached --others --exclude-standard \
     | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
     | tar --null -T - --transform "s,^,$2/," --owner=0 --group=0 -czf "$3")
}
