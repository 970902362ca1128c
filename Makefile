# Two commands on a bare machine (Python ≥ 3.10 with venv and a C++ compiler):
#   make demo   install kvcached + kvctl into .venv and run `kvctl demo`
#   make test   install the test dependencies (vLLM 0.34 and SGLang 0.5.23 without a GPU included) and run the suite
# and for developers: make test-vllm033 (tests/vllm again, on vLLM 0.33 in a second venv), make test-fast (the
# tests that need neither vLLM nor SGLang), make lint (ruff + mypy), make bench, make completions.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: demo test test-vllm033 test-fast lint bench completions clean install-docs install-cron install-systemd image

# The suite runs on PYTEST_WORKERS processes (pytest-xdist; 1: in pytest's own process, as plain pytest does).
# Tests share a worker where they share a fixture (tests/conftest.py, docs/CONTRIBUTING.md "Tests").
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)

# What `make demo` needs: kvcached + kvctl (and the extension they build), nothing else.
$(VENV)/.base: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PIP) install -q -e .
	touch $@

# What the tests add: pytest and friends, then vLLM (0.34, install-vllm.sh's default) without a GPU.
$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e '.[test]'
	touch $@

# The lowest typer of pyproject's range, in a directory of its own that tests/cli/test_operators.py puts
# first on the path (with what pip resolves for it): installed here, so that the suite reaches no index.
TYPER_LOWEST := $(shell sed -n 's/^ *"typer>=\([0-9.]*\),.*/\1/p' pyproject.toml)
TYPER_LOWEST_PIN := $(if $(word 3,$(subst ., ,$(TYPER_LOWEST))),$(TYPER_LOWEST),$(TYPER_LOWEST).0)
$(VENV)/typer-lowest/.done: pyproject.toml | $(VENV)/.test
	rm -rf $(VENV)/typer-lowest
	$(PIP) install -q --target $(VENV)/typer-lowest "typer==$(TYPER_LOWEST_PIN)"
	touch $@

$(VENV)/.vllm: $(VENV)/.test scripts/install-vllm.sh
	. $(VENV)/bin/activate && bash scripts/install-vllm.sh
	touch $@

# SGLang goes in after vLLM, keeping vLLM's pins (scripts/install-sglang.sh reads them).
$(VENV)/.sglang: $(VENV)/.vllm scripts/install-sglang.sh scripts/torchvision_cpu_ops.py
	. $(VENV)/bin/activate && bash scripts/install-sglang.sh
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/kvctl demo

test: $(VENV)/.sglang $(VENV)/typer-lowest/.done
	$(PY) -m pytest -q -ra $(XDIST) $(PYTEST_ARGS)

# The other proven vLLM (kvcached.integration.vllm.common.PROVEN_VERSIONS): its own venv, which runs tests/vllm only
# (docs/CONTRIBUTING.md, "Two venvs, two vLLMs"). Its torch is the same local CPU wheel.
VENV033 ?= .venv-vllm033
PY033 := $(VENV033)/bin/python
$(VENV033)/.vllm: pyproject.toml setup.py scripts/install-vllm.sh
	python3 -m venv $(VENV033)
	$(PY033) -m pip --disable-pip-version-check install -q -e '.[test]'
	. $(VENV033)/bin/activate && bash scripts/install-vllm.sh 0.33.0
	touch $@

test-vllm033: $(VENV033)/.vllm
	KVCACHED_REQUIRE_VLLM=$${KVCACHED_REQUIRE_VLLM:+0.33.0} $(PY033) -m pytest -q -ra $(XDIST) tests/vllm $(PYTEST_ARGS)

# The edit-test loop: everything but tests/vllm and tests/sglang (and the few tests elsewhere marked vllm
# or sglang), on a venv without either engine. Not enough before a push: CI runs make test.
test-fast: $(VENV)/.test $(VENV)/typer-lowest/.done
	$(PY) -m pytest -q -ra $(XDIST) --ignore=tests/vllm --ignore=tests/sglang -m "not vllm and not sglang" $(PYTEST_ARGS)

$(VENV)/.lint: $(VENV)/.test
	$(PIP) install -q -e '.[lint]'
	touch $@

# The lint and type gate (CI runs it after the tests): ruff, then mypy, as configured in pyproject.toml.
lint: $(VENV)/.lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(VENV)/.sglang
	$(PY) bench/run_all.py

completions: $(VENV)/.base
	$(PY) scripts/gen_completions.py

# A node's scheduled gc (docs/KVCTL.md §11), after `pip install .` put kvctl in /usr/local/bin: one of cron or
# systemd, each with tmpfiles.d's exclusions and the documents the units' Documentation= names. DESTDIR: another root.
DOCDIR := $(DESTDIR)/usr/local/share/doc/kvcached
install-docs:
	install -d $(DOCDIR)
	install -m 644 README.md docs/KVCTL.md docs/RUNBOOK.md $(DOCDIR)/
	install -D -m 644 contrib/tmpfiles.d/kvcached.conf $(DESTDIR)/etc/tmpfiles.d/kvcached.conf

install-cron: install-docs
	install -D -m 644 contrib/cron/kvctl-gc $(DESTDIR)/etc/cron.d/kvctl-gc

install-systemd: install-docs
	install -d $(DESTDIR)/etc/systemd/system
	install -m 644 contrib/systemd/kvctl-gc.service contrib/systemd/kvctl-gc.timer $(DESTDIR)/etc/systemd/system/

# The agent's image (contrib/kubernetes/Containerfile): its version is pyproject.toml's, its labels' revision and
# source git's. PLATFORM=linux/arm64 for Grace nodes (natively, or through QEMU's binfmt on x86_64);
# BUILDER="podman build" for podman. contrib/kubernetes/README.md ("The image") says the rest.
IMAGE_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
SOURCE ?= $(shell git config --get remote.origin.url 2>/dev/null)
IMAGE ?= registry.example.com/kvcached/kvctl:$(IMAGE_VERSION)
PLATFORM ?= linux/amd64
BUILDER ?= docker buildx build
image:
	@test -n "$(SOURCE)" || { echo "make image: no git remote: give SOURCE=<the repository's URL>" >&2; exit 2; }
	$(BUILDER) --platform $(PLATFORM) -f contrib/kubernetes/Containerfile --build-arg VERSION=$(IMAGE_VERSION) \
	  --build-arg REVISION=$(REVISION) --build-arg SOURCE=$(SOURCE) -t $(IMAGE) .

# Build outputs, and nothing else: the venv, setuptools' build tree and metadata, and the
# compiled extension (kvcached/runtime/_kvpages*.so; every .so under kvcached/ is one, an
# older build's kvcached/_kvpages*.so included). Tool caches (.pytest_cache, .mypy_cache,
# .ruff_cache, .hypothesis) are not build outputs and stay.
clean:
	rm -rf $(VENV) $(VENV033) build *.egg-info
	find kvcached -name '*.so' -type f -delete
