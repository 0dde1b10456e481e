# The two commands a newcomer needs: `make demo` and `make test`. Both build the
# environment first (`make install`: .venv/ with the project and its test tools).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Out-of-tree plugin packages under examples/, installed (editable) beside the project so the
# tests load them through their entry points; a change to one's pyproject reinstalls.
EXAMPLE_PROJECTS := $(wildcard examples/*/pyproject.toml)

.PHONY: install redis kubectl podman check test demo demo-ha bench wheels image image-test clean

install: $(STAMP) redis kubectl podman

# The Redis tests (tests/contract) start real redis-server processes: Debian's redis-server
# and redis-tools packages, installed when missing (CI runs as root on a fresh Debian).
redis:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	( (apt-get update && apt-get install -y redis-server redis-tools) >/dev/null && \
	  command -v redis-server >/dev/null ) || \
	{ echo "make install: the tests need redis-server and redis-cli, and installing them" \
	  "failed. Install Debian's redis-server and redis-tools packages" \
	  "(apt-get install -y redis-server redis-tools, as root), or put a Redis >= 7" \
	  "redis-server and redis-cli on PATH." >&2; exit 1; }

# The manifest tests (tests/deploy) render deploy/kubernetes with `kubectl kustomize`: Debian's
# kubernetes-client package, installed when no kubectl is on PATH.
kubectl:
	@command -v kubectl >/dev/null || \
	( (apt-get update && apt-get install -y kubernetes-client) >/dev/null && \
	  command -v kubectl >/dev/null ) || \
	{ echo "make install: the tests need kubectl, and installing it failed. Install Debian's" \
	  "kubernetes-client package (apt-get install -y kubernetes-client, as root), or put" \
	  "any kubectl on PATH." >&2; exit 1; }

# The image tests (tests/image) build the Containerfile on a local Debian base and run it:
# Debian's podman and mmdebstrap, installed when missing.
podman:
	@command -v podman >/dev/null && command -v mmdebstrap >/dev/null || \
	( (apt-get update && apt-get install -y podman mmdebstrap) >/dev/null && \
	  command -v podman >/dev/null && command -v mmdebstrap >/dev/null ) || \
	{ echo "make install: the image tests need podman and mmdebstrap, and installing them" \
	  "failed. Install Debian's podman and mmdebstrap packages (as root)." >&2; exit 1; }

$(STAMP): pyproject.toml $(EXAMPLE_PROJECTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]' \
		$(foreach project,$(EXAMPLE_PROJECTS),-e $(dir $(project)))
	@# xds-protos ships an older copy of the OpenTelemetry protos into the same package
	@# directory; whichever installs last wins. Reinstall opentelemetry-proto so its own
	@# (newer, compatible) modules are the ones on disk, whatever the install order was.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall \
		"opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	@touch $(STAMP)

# Architecture contracts, lint and types.
check: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The suite in one pytest process per core (a file's tests stay together, so its module
# fixtures, such as the image build, run once), then alone the tests that assert how long
# something takes (marked `timed`), so that no other test shares the machine with them.
test: check
	$(BIN)/pytest -q -n auto --dist loadfile -m "not timed"
	$(BIN)/pytest -q -m timed

demo: install
	$(BIN)/python -m tests.demo

# Three EPP replicas sharing their state on one redis-server (installed by `make install`).
demo-ha: install
	$(BIN)/python -m tests.demo_ha

bench: install redis
	$(BIN)/python -m tests.bench.extproc_overhead
	$(BIN)/python -m tests.bench.extproc_overhead --workers 1,2,auto --rounds 4 --stream-requests 500

# The wheels the image installs, no test tools: build/wheels/deps (the runtime dependencies,
# resolved again only when pyproject.toml changes; async-timeout is one of redis's only below
# Python 3.11.3, Debian's is 3.11.2) and build/wheels/project (this project's, built every
# time; hatchling's wheels are reproducible, so an unchanged tree gives the same bytes and the
# image build reuses its cached layers).
WHEELS := build/wheels
PIP := $(BIN)/python -m pip --quiet --disable-pip-version-check
$(WHEELS)/deps/.complete: pyproject.toml | install
	rm -rf $(WHEELS)/deps
	$(PIP) wheel --wheel-dir $(WHEELS)/deps . "async-timeout>=4.0.3"
	rm -f $(WHEELS)/deps/epp-*.whl
	@touch $@

wheels: install $(WHEELS)/deps/.complete
	rm -rf $(WHEELS)/project $(WHEELS)/*.whl
	$(PIP) wheel --no-deps --wheel-dir $(WHEELS)/project .

# The EPP's image from Containerfile, tagged with the project's version, with the first of
# podman, docker or buildah on PATH (BASE_IMAGE=... to build on another base).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= epp:$(VERSION)
BUILD_ARGS := $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE))
image: wheels
	@builder=$$(command -v podman || command -v docker || command -v buildah || true); \
	if [ -z "$$builder" ]; then \
	  echo "make image: no podman, docker or buildah on PATH" >&2; exit 1; fi; \
	case "$$builder" in \
	  *buildah) set -x; "$$builder" bud $(BUILD_ARGS) -f Containerfile -t $(IMAGE) . ;; \
	  *podman) set -x; "$$builder" build --isolation chroot $(BUILD_ARGS) -f Containerfile -t $(IMAGE) . ;; \
	  *) set -x; "$$builder" build $(BUILD_ARGS) -f Containerfile -t $(IMAGE) . ;; \
	esac

# The image test alone (also part of `make test`), with its figures: size, seconds per step.
image-test: install
	$(BIN)/pytest -q -s tests/image

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache .hypothesis
