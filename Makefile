# Moonlease developer entry points. `make demo` and `make test` set everything up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
## WORKERS: pytest-xdist workers of `make test` (the engine tests share one; 0 runs it in one process)
WORKERS ?= 2

.PHONY: setup demo test test-fast test-unit lint crds chart-docs docs images release clean-setup

## setup: Debian packages, the virtualenvs, the CPU libcuda stub (quick when already done)
setup:
	@bash tools/setup.sh

## demo: the end-to-end run through the real parts
demo: setup
	@$(VENV)/bin/moonlease demo

## test: every tier (unit, slow, compat, store, vllm, operator, chart, prometheus, images, conformance),
## on $(WORKERS) workers: most tiers wait on servers and timers, so two tests overlap (tests/conftest.py
## groups them: the engine tests one at a time, a module's tests together)
test: setup
	@$(PY) -m pytest -n $(WORKERS) --dist loadgroup $(PYTEST_ARGS)

## test-fast: the inner loop: pure logic only, no servers, no engines, no upstream suites
test-fast: setup
	@$(PY) -m pytest -m unit $(PYTEST_ARGS)

## test-unit: the same as test-fast (kept for existing habits)
test-unit: test-fast

## lint: ruff, mypy (strict on the pure cores) and the import layering contracts
lint: setup
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/mypy
	@$(VENV)/bin/lint-imports

## crds: regenerate crds/ from the pydantic models, and the chart's copy (byte-identical)
crds: setup
	@$(VENV)/bin/moonlease crd > crds/mooncakeleasepolicies.yaml
	@cp crds/mooncakeleasepolicies.yaml charts/moonlease/crds/mooncakeleasepolicies.yaml

## images: build the operator, mooncake and connector-cpu images with podman (installs podman,
## configures it and makes a Debian base the first time; see tools/images.sh)
images:
	@bash tools/images.sh

## release: after checking the versions (of the three product distributions, their pins on each other
## and the chart), the CHANGELOG and that the chart's default images name a
## registry, build the images (tools/images.sh; IMAGES="operator mooncake connector" to choose) with a
## CycloneDX SBOM each, and package the chart, all into dist/. REGISTRY is where you will push the
## images (it becomes the chart's global.imageRegistry): make release REGISTRY=host/path
## A chart-only release (no image, no SBOM): make release REGISTRY=host/path SKIP_IMAGES=1
release: setup
	@$(PY) tools/release.py --registry "$(REGISTRY)" --out dist $(if $(SKIP_IMAGES),--skip-images) $(if $(IMAGES),--images $(IMAGES))

## docs: build the documentation site (docs/, mkdocs.yml) into site/, failing on any warning (a broken link or anchor)
docs: setup
	@$(VENV)/bin/mkdocs build --strict

## chart-docs: regenerate the chart's values reference (docs/helm.md, charts/moonlease/README.md) from values.schema.json
chart-docs: setup
	@$(PY) tools/chart_values_doc.py --write docs/helm.md
	@$(PY) tools/chart_values_doc.py --write charts/moonlease/README.md

clean-setup:
	rm -rf $(VENV) .venv-mooncake-0.3.13 .venv-vllm-0.33 .venv-sbom
