# One-command entry points. `make train-ocr` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
# The Paddle GPU image runs Python 3.10, so the Paddle venv does too when this host has a 3.10
# (pyenv's, or python3.10 on PATH): the Paddle half of `make test` then proves the image's Python.
# PADDLE_PYTHON=python3 (or any interpreter) overrides; without a 3.10 it falls back to $(PYTHON).
PADDLE_PYTHON ?= $(or $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.10.*/bin/python3.10)),$(shell command -v python3.10 2>/dev/null),$(PYTHON))
PADDLE := .venv-paddle/bin/python
TORCH := .venv-torch/bin/python
PIP_FLAGS ?= --disable-pip-version-check --progress-bar off
RUNTIME_REQS := requirements/common.txt requirements/remote.txt requirements/constraints.txt

OCR_DATA := data/synth_ocr
# The smoke jobs start over each time; pass ARGS=--resume (or other train flags) to change that.
ARGS ?= --overwrite
IMAGENET_DATA := data/synth_imagenet

.PHONY: setup train-ocr train-resnet50 data test test-torch test-paddle lint format clean-venvs \
	doctor bench bench-quick containers-ci finetune-ocr test-quick tune gpu-wheelhouse \
	setup-compat test-compat

setup: .venv-paddle/.installed .venv-torch/.installed

# Three stamps a venv: .runtime (what the images install: the framework, common.txt, remote.txt),
# .project (this project, installed editable, as in the images), which the training and data
# targets need, and .installed (requirements/dev.txt on top: linters, the S3 test server,
# Compose, schema checkers), which the tests need. A stamp is rebuilt only when its files change
# (it is older than them).
.venv-paddle/.runtime: requirements/paddle.txt $(RUNTIME_REQS)
	$(PADDLE_PYTHON) -m venv .venv-paddle
	$(PADDLE) -m pip install $(PIP_FLAGS) -q --upgrade pip
	$(PADDLE) -m pip install $(PIP_FLAGS) -r requirements/paddle.txt -r requirements/remote.txt -c requirements/constraints.txt
	touch $@

.venv-torch/.runtime: requirements/torch.txt $(RUNTIME_REQS)
	$(PYTHON) -m venv .venv-torch
	$(TORCH) -m pip install $(PIP_FLAGS) -q --upgrade pip
	$(TORCH) -m pip install $(PIP_FLAGS) -r requirements/torch.txt -r requirements/remote.txt -c requirements/constraints.txt
	touch $@

# The project itself, editable and without dependencies (the requirement files above are its
# dependencies): `train`, `datasets`, `bench` and `scripts` then import from this checkout in any
# directory, and from a file run by path (Paddle's launcher runs train/__main__.py). Rebuilt when
# pyproject.toml changes; cheap (setuptools builds a finder, no files are copied).
.venv-%/.project: .venv-%/.runtime pyproject.toml
	.venv-$*/bin/python -m pip install $(PIP_FLAGS) -q --no-deps -e .
	touch $@

.venv-%/.installed: .venv-%/.project requirements/dev.txt
	.venv-$*/bin/python -m pip install $(PIP_FLAGS) -r requirements/dev.txt -c requirements/constraints.txt
	touch $@

$(OCR_DATA)/charset.txt: | .venv-paddle/.project
	# Digit lines of 3-6 characters: a tiny CRNN reads them after ~200 CPU steps (the smoke
	# job's point is to show learning in minutes; --charset latin|full makes harder data).
	$(PADDLE) -m scripts.make_synthetic ocr --out $(OCR_DATA) --num 4000 --charset digits --max-len 6 --seed 0 --overwrite

$(IMAGENET_DATA)/train.h5: | .venv-torch/.project
	$(TORCH) -m scripts.make_synthetic imagenet --out $@ --num 2000 --classes 10 --seed 0 --overwrite

$(IMAGENET_DATA)/val.h5: | .venv-torch/.project
	$(TORCH) -m scripts.make_synthetic imagenet --out $@ --num 400 --classes 10 --seed 1 --overwrite

data: $(OCR_DATA)/charset.txt $(IMAGENET_DATA)/train.h5 $(IMAGENET_DATA)/val.h5

# The main job: OCR smoke training on PaddlePaddle, CPU.
train-ocr: .venv-paddle/.project $(OCR_DATA)/charset.txt
	$(PADDLE) -m train --config configs/ocr/smoke.yaml $(ARGS)

train-resnet50: .venv-torch/.project $(IMAGENET_DATA)/train.h5 $(IMAGENET_DATA)/val.h5
	$(TORCH) -m train --config configs/resnet50/smoke.yaml $(ARGS)

# Fine-tune PaddleOCR's released PP-OCRv4 recognizer on dot-matrix lines (docs/ppocrv4.md):
# fetch the released ONNX and a CJK font (once), write the hard domain and a clean set, convert
# the weights, read both sets zero-shot, fine-tune on the CPU, read both again.
# FINETUNE_FRAMEWORK=torch runs the torch twin.
FINETUNE_FRAMEWORK ?= paddle
PPOCRV4_DOTS := $(OCR_DATA)/ppocrv4_dots
PPOCRV4_CLEAN := $(OCR_DATA)/ppocrv4_clean
PPOCRV4_FONT := .cache/ppocrv4/NotoSansCJKtc-Regular.otf
FINETUNE_PY := $(if $(filter torch,$(FINETUNE_FRAMEWORK)),$(TORCH),$(PADDLE))
FINETUNE_CONFIG := configs/ocr/finetune_ppocrv4$(if $(filter torch,$(FINETUNE_FRAMEWORK)),_torch).yaml
FINETUNE_WEIGHTS := .cache/ppocrv4/ppocrv4_rec$(if $(filter torch,$(FINETUNE_FRAMEWORK)),.pt,.pdparams)
FINETUNE_RUN := runs/ocr-$(FINETUNE_FRAMEWORK)-finetune_ppocrv4$(if $(filter torch,$(FINETUNE_FRAMEWORK)),_torch)

$(PPOCRV4_FONT): | .venv-paddle/.project
	$(PADDLE) -m scripts.fetch_ppocrv4

$(PPOCRV4_DOTS)/charset.txt: | $(PPOCRV4_FONT)
	$(PADDLE) -m scripts.make_synthetic ocr --out $(PPOCRV4_DOTS) --num 1200 --val-fraction 0.1667 --charset full --font $(PPOCRV4_FONT) --domain dot_matrix --seed 0 --overwrite --quiet

$(PPOCRV4_CLEAN)/charset.txt: | $(PPOCRV4_FONT)
	$(PADDLE) -m scripts.make_synthetic ocr --out $(PPOCRV4_CLEAN) --num 400 --val-fraction 0.5 --charset full --font $(PPOCRV4_FONT) --seed 7 --overwrite --quiet

finetune-ocr: .venv-$(FINETUNE_FRAMEWORK)/.project $(PPOCRV4_DOTS)/charset.txt $(PPOCRV4_CLEAN)/charset.txt
	$(FINETUNE_PY) -m scripts.convert_weights --quiet --dict-out $(PPOCRV4_DOTS)/ppocr_keys.txt
	@echo "zero-shot (released weights):"
	$(FINETUNE_PY) -m train.evaluate --config $(FINETUNE_CONFIG) --weights $(FINETUNE_WEIGHTS) --data $(PPOCRV4_DOTS)/val --data $(PPOCRV4_CLEAN)/val
	$(FINETUNE_PY) -m train --config $(FINETUNE_CONFIG) $(ARGS)
	@echo "fine-tuned (the run's last checkpoint):"
	$(FINETUNE_PY) -m train.evaluate --checkpoint $$(ls -d $(FINETUNE_RUN)/checkpoints/step-* | tail -1) --data $(PPOCRV4_DOTS)/val --data $(PPOCRV4_CLEAN)/val

doctor: .venv-paddle/.project
	$(PADDLE) -m train.doctor --config $(or $(CONFIG),configs/ocr/smoke.yaml)

# The loader tuner on this host: make tune CONFIG=configs/ocr/single_gpu.yaml [ARGS=...], ARGS
# being python -m train.tune's own (--set, --budget-s, --step-ms, --output-dir; not training's
# --overwrite default). It runs in the venv of the config's framework, with the task's synthetic
# data made first (the scenario files point at it unless *_DATA_DIR says otherwise). The framework
# and task are read from the config as resolved (extends, and the --set items in ARGS) by
# python -m train.config --get, in whichever venv exists (either reads any config; the Paddle
# one is made when neither is). FRAMEWORK=paddle|torch skips that reading.
tune: ARGS =
tune:
	@test -n "$(CONFIG)" || { echo "make tune: CONFIG=configs/<task>/<scenario>.yaml is required" >&2; exit 2; }
	@sets=(); words=($(ARGS)); \
	for ((i = 0; i < $${#words[@]}; i++)); do \
		case "$${words[i]}" in --set) sets+=(--set "$${words[i + 1]}");; --set=*) sets+=("$${words[i]}");; esac; \
	done; \
	reader=$(PADDLE); \
	if [ ! -f .venv-paddle/.project ]; then \
		if [ -f .venv-torch/.project ]; then reader=$(TORCH); \
		else $(MAKE) --no-print-directory .venv-paddle/.project || exit $$?; fi; \
	fi; \
	framework="$(FRAMEWORK)"; \
	if [ -z "$$framework" ]; then \
		framework=$$($$reader -m train.config $(CONFIG) "$${sets[@]}" --get framework) || exit 2; \
	fi; \
	task=$$($$reader -m train.config $(CONFIG) "$${sets[@]}" --get task) || exit 2; \
	case "$$task" in \
		ocr) data="$(OCR_DATA)/charset.txt";; \
		classification) data="$(IMAGENET_DATA)/train.h5 $(IMAGENET_DATA)/val.h5";; \
		*) data="";; \
	esac; \
	$(MAKE) --no-print-directory .venv-$$framework/.project $$data || exit $$?; \
	echo ".venv-$$framework/bin/python -m train.tune --config $(CONFIG) $(ARGS)"; \
	.venv-$$framework/bin/python -m train.tune --config $(CONFIG) $(ARGS)

# Input-pipeline benchmark: each framework's part in its own env, merged into one report.
bench-quick: .venv-torch/.installed .venv-paddle/.installed
	$(TORCH) -m scripts.bench_loader --preset quick --out bench/results/quick-torch.json
	$(PADDLE) -m scripts.bench_loader --preset quick --out bench/results/quick-paddle.json
	$(TORCH) -m scripts.bench_loader --merge bench/results/quick-torch.json bench/results/quick-paddle.json --out bench/results/quick.json

bench: .venv-torch/.installed .venv-paddle/.installed
	$(TORCH) -m scripts.bench_loader --preset full --out bench/results/full-torch.json
	$(PADDLE) -m scripts.bench_loader --preset full --out bench/results/full-paddle.json
	$(TORCH) -m scripts.bench_loader --merge bench/results/full-torch.json bench/results/full-paddle.json --out bench/results/full.json

lint: .venv-torch/.installed
	.venv-torch/bin/ruff check .
	.venv-torch/bin/ruff format --check .

format: .venv-torch/.installed
	.venv-torch/bin/ruff check --fix .
	.venv-torch/bin/ruff format .

# Framework-free tests run in both envs; framework tests in their own env. TEST_FRAMEWORK makes
# a framework test that cannot import its framework fail instead of skipping.
# The two halves run at the same time: each keeps about one core busy on average (subprocess
# trainings wait on their workers and on process start-up), so together they fill a 2-core host
# and finish in about the longer half's time instead of the sum (docs/testing.md). The Paddle
# half's output goes to .cache/test-reports/paddle.log and is printed when both are done;
# TEST_SERIAL=1 runs them one after the other. Both halves run even when one fails, so one run
# shows every failure. Each prints its 20 slowest tests and writes every test's time to
# .cache/test-reports/<half>.xml (JUnit XML).
TEST_REPORTS := .cache/test-reports
test: setup lint
	@mkdir -p $(TEST_REPORTS); status=0; \
	if [ "$(TEST_SERIAL)" = 1 ]; then \
		$(MAKE) --no-print-directory test-torch || status=1; \
		$(MAKE) --no-print-directory test-paddle || status=1; \
	else \
		echo "test: the Paddle half runs beside the torch half; its output follows at the end"; \
		$(MAKE) --no-print-directory test-paddle > $(TEST_REPORTS)/paddle.log 2>&1 & paddle=$$!; \
		$(MAKE) --no-print-directory test-torch || status=1; \
		wait $$paddle || status=1; \
		echo "---- test-paddle (ran beside test-torch; also in $(TEST_REPORTS)/paddle.log) ----"; \
		cat $(TEST_REPORTS)/paddle.log; \
	fi; exit $$status

test-torch: .venv-torch/.installed
	@echo "test-torch: $$($(TORCH) --version) ($(TORCH))"
	TEST_FRAMEWORK=torch $(TORCH) -m pytest -m "not paddle" --durations=20 --junitxml=$(TEST_REPORTS)/torch.xml $(PYTEST_ARGS)

test-paddle: .venv-paddle/.installed
	@echo "test-paddle: $$($(PADDLE) --version) ($(PADDLE))"
	TEST_FRAMEWORK=paddle $(PADDLE) -m pytest -m "not torch" --durations=20 --junitxml=$(TEST_REPORTS)/paddle.xml $(PYTEST_ARGS)

# The unit tier of both halves, for the inner loop: every test but the measured slow ones
# (tests/slow_tests.txt, made from make test's reports by python -m tests.tiers).
# The halves run at the same time, as in make test.
test-quick: .venv-torch/.installed .venv-paddle/.installed
	@mkdir -p $(TEST_REPORTS); status=0; \
	TEST_FRAMEWORK=paddle $(PADDLE) -m pytest -q -m "not torch and not slow" $(PYTEST_ARGS) > $(TEST_REPORTS)/paddle-quick.log 2>&1 & paddle=$$!; \
	TEST_FRAMEWORK=torch $(TORCH) -m pytest -q -m "not paddle and not slow" $(PYTEST_ARGS) || status=1; \
	wait $$paddle || status=1; \
	echo "---- Paddle half (ran beside the torch half; also in $(TEST_REPORTS)/paddle-quick.log) ----"; \
	cat $(TEST_REPORTS)/paddle-quick.log; exit $$status

# Line and branch coverage of train/, datasets/, bench/ and scripts/ over both halves of the suite,
# the trainings, launcher ranks and loader workers the tests start included (tests/coverage.cfg,
# docs/testing.md). The halves run side by side as in make test, the Paddle half's output in
# $(COVERAGE_OUT)/paddle.log. A failing test does not stop the measurement (the tracer's slowdown
# can fail a timing-sensitive test): both halves' exit codes and failures are printed, and the
# target fails only when a half could not run its tests. Writes $(COVERAGE_OUT)/coverage.json
# (with the measured files' text, for python -m tests.coverage_gaps BEFORE AFTER), coverage.txt
# and each half's JUnit XML; PYTEST_ARGS measures a subset.
COVERAGE_OUT ?= .cache/coverage
.PHONY: coverage
coverage: .venv-torch/.installed .venv-paddle/.installed
	@rm -rf $(COVERAGE_OUT); mkdir -p $(COVERAGE_OUT)/data; \
	export COVERAGE_RCFILE=$(abspath tests/coverage.cfg) COVERAGE_DATA_DIR=$(abspath $(COVERAGE_OUT))/data; \
	for python in $(TORCH) $(PADDLE); do \
		from=$$(cd / && $(CURDIR)/$$python -c 'import os, train; print(os.path.dirname(os.path.dirname(train.__file__)))' 2>/dev/null); \
		[ "$$from" = "$(CURDIR)" ] || echo "coverage: warning: outside this checkout $$python imports train from $${from:-nowhere}" \
			"(its editable install): a process started in another directory measures none of this checkout's code"; \
	done; \
	echo "coverage: the Paddle half runs beside the torch half; its output follows at the end"; \
	TEST_FRAMEWORK=paddle $(PADDLE) -m coverage run -m pytest -m "not torch" --durations=20 \
		--junitxml=$(COVERAGE_OUT)/paddle.xml $(PYTEST_ARGS) > $(COVERAGE_OUT)/paddle.log 2>&1 & paddle=$$!; \
	TEST_FRAMEWORK=torch $(TORCH) -m coverage run -m pytest -m "not paddle" --durations=20 \
		--junitxml=$(COVERAGE_OUT)/torch.xml $(PYTEST_ARGS) 2>&1 | tee $(COVERAGE_OUT)/torch.log; \
	torch_status=$${PIPESTATUS[0]}; wait $$paddle; paddle_status=$$?; \
	echo "---- Paddle half (ran beside the torch half; also in $(COVERAGE_OUT)/paddle.log) ----"; \
	cat $(COVERAGE_OUT)/paddle.log; \
	echo "---- coverage of both halves ----"; \
	$(TORCH) -m coverage combine -q && \
	$(TORCH) -m coverage json -q -o $(COVERAGE_OUT)/coverage.json && \
	$(TORCH) -m coverage report > $(COVERAGE_OUT)/coverage.txt && \
	$(TORCH) -m tests.coverage_gaps --snapshot $(COVERAGE_OUT)/coverage.json || exit 1; \
	echo "report: $(COVERAGE_OUT)/coverage.json, $(COVERAGE_OUT)/coverage.txt"; \
	echo "pytest exit codes: torch half $$torch_status, Paddle half $$paddle_status" \
		"(0 passed, 1 tests failed, 5 none selected)"; \
	for half in torch paddle; do grep '^FAILED\|^ERROR' $(COVERAGE_OUT)/$$half.log | sed "s/^/$$half half: /"; done; \
	for status in $$torch_status $$paddle_status; do \
		case $$status in 0|1|5) ;; *) echo "a half did not run its tests: the coverage is partial"; exit 1;; esac; \
	done

# What CI does with containers: start a Docker Engine of its own, build both images on CPU
# stand-ins of the GPU bases, and run the README's compose commands (needs root; installs
# docker.io, debootstrap and Compose v2 itself). See docs/containers.md.
containers-ci:
	bash scripts/ci_containers.sh

clean-venvs:
	rm -rf .venv-paddle .venv-torch .venv-compat

# A borrowed GPU host has a preinstalled PyTorch and no package index (docs/first_gpu_run.md).
# gpu-wheelhouse: the few wheels such a host lacks (requirements/gpu-wheelhouse.txt), for its
# Python (PY, default 3.12), to carry along: scripts/gpu_check.sh --wheelhouse DIR installs them
# there with --no-index. Prints their count and total size.
PY ?= 3.12
WHEELHOUSE_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
gpu-wheelhouse: .cache/gpu-wheelhouse/py$(PY)/.done
.cache/gpu-wheelhouse/py%/.done: requirements/gpu-wheelhouse.txt
	rm -rf $(@D) && mkdir -p $(@D)
	$(PYTHON) -m pip download $(PIP_FLAGS) -q --no-deps --only-binary=:all: --implementation cp \
		--python-version $* $(WHEELHOUSE_PLATFORMS) -d $(@D) -r requirements/gpu-wheelhouse.txt
	@echo "gpu-wheelhouse: $$(ls $(@D)/*.whl | wc -l) wheels, $$(du -cb $(@D)/*.whl | tail -n 1 | cut -f1) bytes in $(@D)"
	touch $@

# The torch side on the newest stack such a host runs: .venv-compat is the host's Python 3.12
# with requirements/gpu-host.txt (torch 2.11, numpy 2: what one GPU host had preinstalled), then
# the wheelhouse installed with --no-index, as on the host. test-compat runs the torch unit tier,
# one ResNet and one OCR training, and the GPU check's dry run with --wheelhouse and no package
# index (tests/test_gpu_check.py). CI runs it as its own stage, after make test.
COMPAT_PYTHON ?= $(or $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12.*/bin/python3.12)),$(shell command -v python3.12 2>/dev/null))
COMPAT := .venv-compat/bin/python
setup-compat: .venv-compat/.installed
.venv-compat/.installed: requirements/gpu-host.txt .cache/gpu-wheelhouse/py3.12/.done
	@test -n "$(COMPAT_PYTHON)" || { echo "setup-compat: no Python 3.12 here (pyenv's versions/3.12.*, or python3.12 on PATH); set COMPAT_PYTHON=/path/to/python3.12" >&2; exit 2; }
	$(COMPAT_PYTHON) -m venv .venv-compat
	$(COMPAT) -m pip install $(PIP_FLAGS) -r requirements/gpu-host.txt
	$(COMPAT) -m pip install $(PIP_FLAGS) --no-index --no-deps .cache/gpu-wheelhouse/py3.12/*.whl
	touch $@

test-compat: .venv-compat/.installed
	@echo "test-compat: $$($(COMPAT) --version) ($(COMPAT)), $$($(COMPAT) -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)')"
	TEST_FRAMEWORK=torch TEST_COMPAT=1 $(COMPAT) -m pytest -m "not paddle and (not slow or compat)" --durations=10 --junitxml=$(TEST_REPORTS)/compat.xml $(PYTEST_ARGS)
