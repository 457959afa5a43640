# gpu-agent developer entry points. Each target creates or reuses .venv and installs what it
# needs, so `make demo` and `make test` work on a fresh Debian machine with python3 and gcc.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-stamp
# Debian packages the targets need; installed with apt-get when missing (as root only).
APT_BUILD := gcc python3-dev python3-venv

.PHONY: all venv build test lint demo proto bench clean

all: build

$(STAMP): requirements.txt requirements-dev.txt
	@command -v gcc >/dev/null 2>&1 || scripts/apt-install $(APT_BUILD)
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV) || \
	  { scripts/apt-install python3-venv && $(PYTHON) -m venv $(VENV); }
	$(VPY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

venv: $(STAMP)

# Compiles agent/_fast (Cython) and agent/sim/lib/libnvidia-ml.so.1 in place, and installs the
# `gpu-agent` command into .venv (editable, so the tree is what runs).
build: $(STAMP)
	$(VPY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	$(VPY) setup.py -q build_ext --inplace

lint: $(STAMP)
	$(VPY) -m ruff check .

test: build lint
	$(VPY) -m pytest -q

demo: build
	$(VENV)/bin/gpu-agent demo

# Regenerates agent/_proto from proto/ (committed; tests/test_proto.py fails when stale).
proto: $(STAMP)
	$(VPY) scripts/gen_proto.py

bench: build
	$(VPY) -m bench

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	rm -f agent/_fast/*.c agent/_fast/*.so agent/sim/lib/*.so*
	find . -name __pycache__ -prune -exec rm -rf {} +
