# gpu-agent developer entry points. Each target creates or reuses .venv and installs what it
# needs, so `make demo` and `make test` work on a fresh Debian machine with python3 and gcc.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-stamp
# Debian packages the targets need; installed with apt-get when missing (as root only).
APT_BUILD := gcc python3-dev python3-venv
# What `make rpm` and the packaging tests (tests/test_install.py, tests/test_systemd_unit.py)
# need, and the real Prometheus that tests/test_metrics_prometheus.py scrapes the agent with;
# `make test` installs them as root only (CI), elsewhere those tests say they skipped.
APT_RPM   := rpm rpmlint systemd
# What `make deb` and tests/test_deb.py need beyond dpkg itself: dpkg-shlibdeps and
# dpkg-gencontrol (dpkg-dev), and lintian.
APT_DEB   := dpkg-dev lintian
APT_TEST  := prometheus
# What `make e2e`'s cluster runs beside the components it builds (docs/e2e.md): runc, the
# busybox its pods run, the CNI plugins its runtime's network config names, and openssl for
# its certificates.
APT_E2E   := runc busybox-static containernetworking-plugins openssl
# The Kubernetes versions `make e2e` runs, newest first (one per tests/e2e/components/
# kubernetes-v*); CI runs the newest: `make e2e E2E_K8S=<newest>`.
E2E_K8S   ?= $(shell ls tests/e2e/components | sed -n 's/^kubernetes-v//p' | sort -rV)

.PHONY: all venv build test test-under-load test-pythons lint demo proto bench soak clean rpm \
        deb packaging-tools e2e e2e-build e2e-cluster

all: build

$(STAMP): requirements.txt requirements-dev.txt
	@command -v gcc >/dev/null 2>&1 || scripts/apt-install $(APT_BUILD)
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV) || \
	  { scripts/apt-install python3-venv && $(PYTHON) -m venv $(VENV); }
	$(VPY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

venv: $(STAMP)

# Compiles agent/_fast (Cython) and agent/sim/lib/libnvidia-ml.so.1 in place, and puts the tree
# on .venv's sys.path with a plain .pth line, so the tree is what runs (`.venv/bin/python -m
# agent` is `gpu-agent`). Not `pip install -e`: its import hook costs every Python process
# (each agent the tests start, the start-up bench) about 15 ms that an installed agent never
# pays, and setuptools' hook-free mode is being removed. Then byte-compiles the tree, as the
# packages are (packaging/install-tree): where PYTHONDONTWRITEBYTECODE is set (CI machines,
# containers) no agent process would write its .pyc, and each one the tests and the benches
# start would compile every module it imports again (about a third of its start).
SITE = $$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
build: $(STAMP)
	@rm -f $(SITE)/__editable__*gpu_agent* $(SITE)/__editable__.gpu_agent-*.pth
	@echo "$(CURDIR)" > $(SITE)/gpu-agent-tree.pth
	$(VPY) setup.py -q build_ext --inplace
	$(VPY) -m compileall -q -j0 agent bench tests

lint: $(STAMP)
	$(VPY) -m ruff check .

test: build lint packaging-tools
	$(VPY) -m pytest -q

# The suite RUNS times in a row (stops at the first failure) while stress-ng keeps both cores
# busy, as CI finds the machine right after a stop; each run's time goes to the log.
RUNS ?= 3
test-under-load: build lint packaging-tools
	@command -v stress-ng >/dev/null 2>&1 || scripts/apt-install stress-ng
	@stress-ng --cpu 2 --quiet & load=$$!; trap 'kill $$load 2>/dev/null' EXIT; \
	for run in $$(seq $(RUNS)); do \
	  start=$$(date +%s); $(VPY) -m pytest -q -p no:cacheprovider || exit 1; \
	  echo "run $$run of $(RUNS) under stress-ng --cpu 2: passed in $$(( $$(date +%s) - start )) s"; \
	done

# `make test` on each supported CPython found here (scripts/find-pythons: python3.X on PATH,
# else pyenv's), each in a venv of its own (.venv-3.X, its log in .venv-3.X/test.log), then one
# line per version. PYTHONS="3.9 3.13" runs those only (each must be found).
PYTHONS ?=
test-pythons:
	@scripts/find-pythons $(PYTHONS) > .pythons-found || { rm -f .pythons-found; exit 1; }; \
	status=0; lines=""; \
	while read -r v py; do \
	  start=$$(date +%s); mkdir -p .venv-$$v; \
	  echo "Python $$v ($$py): make test VENV=.venv-$$v ..."; \
	  if $(MAKE) --no-print-directory test PYTHON=$$py VENV=.venv-$$v \
	      > .venv-$$v/test.log 2>&1 < /dev/null; then result=passed; \
	  else result=FAILED; status=1; tail -n 40 .venv-$$v/test.log; fi; \
	  counts=$$(grep -E "[0-9]+ (passed|failed)" .venv-$$v/test.log | tail -n 1 | tr -d '='); \
	  lines="$$lines$$(printf '\nPython %s: %s in %s s (%s)' $$v $$result \
	    $$(( $$(date +%s) - start )) "$$counts")"; \
	done < .pythons-found; rm -f .pythons-found; \
	echo "$$lines"; exit $$status

demo: build
	$(VPY) -m agent demo

# Regenerates agent/_proto from proto/ (committed; tests/test_proto.py fails when stale).
proto: $(STAMP)
	$(VPY) scripts/gen_proto.py

# The RPM into dist/ (packaging/rpm/gpu-agent.spec via scripts/build-rpm), then rpmlint.
rpm: packaging-tools
	@command -v rpmbuild >/dev/null 2>&1 || scripts/apt-install $(APT_RPM)
	@command -v gcc >/dev/null 2>&1 && $(PYTHON) -c 'import ensurepip' 2>/dev/null || \
	  scripts/apt-install $(APT_BUILD)
	rm -f dist/gpu-agent-*.rpm
	scripts/build-rpm --output dist
	@if command -v rpmlint >/dev/null 2>&1; then \
	  rpmlint -r packaging/rpm/gpu-agent.rpmlintrc dist/gpu-agent-*.rpm packaging/rpm/gpu-agent.spec; \
	else echo "rpmlint not installed: not linted"; fi

# The .deb into dist/ (packaging/deb/ via scripts/build-deb, on the system's /usr/bin/python3),
# then lintian, which reads packaging/deb/lintian-overrides from the package.
deb: packaging-tools
	@command -v dpkg-shlibdeps >/dev/null 2>&1 || scripts/apt-install $(APT_DEB)
	@command -v gcc >/dev/null 2>&1 && /usr/bin/python3 -c 'import ensurepip' 2>/dev/null || \
	  scripts/apt-install $(APT_BUILD)
	rm -f dist/gpu-agent_*.deb
	scripts/build-deb --output dist
	@if command -v lintian >/dev/null 2>&1; then \
	  lintian --fail-on error,warning dist/gpu-agent_*.deb; \
	else echo "lintian not installed: not linted"; fi

# The packaging tests' tools (APT_RPM, APT_DEB) and Prometheus, as root only (CI); elsewhere
# those tests are skipped and say why.
packaging-tools:
	@if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  scripts/apt-install $(APT_RPM) $(APT_DEB) $(APT_TEST); fi

# The real Kubernetes components, built from their pinned Go modules into .e2e/bin (cached:
# rebuilt only when a pin changes). Needs Go 1.26 and the Go module proxy.
e2e-build:
	scripts/e2e-build --k8s $(E2E_K8S)

# The end-to-end cases on a real one-node cluster (tests/e2e, docs/e2e.md), once per Kubernetes
# version in E2E_K8S. Root only: kubelet, containerd and the device nodes need it.
e2e: build e2e-build
	@[ "$$(id -u)" -eq 0 ] || { echo "make e2e: needs root (kubelet, containerd, mknod)" >&2; exit 1; }
	@scripts/apt-install $(APT_E2E)
	@for v in $(E2E_K8S); do \
	  start=$$(date +%s); \
	  $(VPY) -m pytest -q -p no:cacheprovider --durations=10 tests/e2e --k8s $$v || exit 1; \
	  echo "e2e on Kubernetes $$v: passed in $$(( $$(date +%s) - start )) s"; \
	done

# The cluster with gpu-agent on a simulated node, kept until Ctrl-C, for trying things by
# hand (docs/e2e.md; `python -m tests.e2e.cluster --help`).
e2e-cluster: build e2e-build
	@scripts/apt-install $(APT_E2E)
	$(VPY) -m tests.e2e.cluster up --k8s $(firstword $(E2E_K8S))

# Byte-compiled by build, as the packages install it (start-up figures would otherwise include
# compiling every module). Its real-kubelet row runs on the e2e cluster (bench/bench_e2e.py),
# hence the Go build.
bench: build e2e-build
	@[ "$$(id -u)" -ne 0 ] || scripts/apt-install $(APT_E2E)
	$(VPY) -m bench

# 10 minutes of pods, XIDs, kubelet restarts and SIGHUPs; its section of docs/benchmarks.md
soak: build
	$(VPY) -m bench soak

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	rm -f agent/_fast/*.c agent/_fast/*.so agent/sim/lib/*.so*
	find . -name __pycache__ -prune -exec rm -rf {} +
