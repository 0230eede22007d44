# One-command entry points. `make train-ocr` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
PADDLE := .venv-paddle/bin/python
TORCH := .venv-torch/bin/python
PIP_FLAGS ?= --disable-pip-version-check --progress-bar off
COMMON_REQS := requirements/common.txt requirements/remote.txt requirements/constraints.txt

OCR_DATA := data/synth_ocr
# The smoke jobs start over each time; pass ARGS=--resume (or other train flags) to change that.
ARGS ?= --overwrite
IMAGENET_DATA := data/synth_imagenet

.PHONY: setup train-ocr train-resnet50 data test test-torch test-paddle lint format clean-venvs \
	doctor bench bench-quick containers-ci

setup: .venv-paddle/.installed .venv-torch/.installed

# A venv is rebuilt only when its requirement files change (the stamp is older than them).
.venv-paddle/.installed: requirements/paddle.txt $(COMMON_REQS)
	$(PYTHON) -m venv .venv-paddle
	$(PADDLE) -m pip install $(PIP_FLAGS) -q --upgrade pip
	$(PADDLE) -m pip install $(PIP_FLAGS) -r requirements/paddle.txt -r requirements/remote.txt -c requirements/constraints.txt
	touch $@

.venv-torch/.installed: requirements/torch.txt $(COMMON_REQS)
	$(PYTHON) -m venv .venv-torch
	$(TORCH) -m pip install $(PIP_FLAGS) -q --upgrade pip
	$(TORCH) -m pip install $(PIP_FLAGS) -r requirements/torch.txt -r requirements/remote.txt -c requirements/constraints.txt
	touch $@

$(OCR_DATA)/charset.txt: | .venv-paddle/.installed
	# Digit lines of 3-6 characters: a tiny CRNN reads them after ~200 CPU steps (the smoke
	# job's point is to show learning in minutes; --charset latin|full makes harder data).
	$(PADDLE) scripts/make_synthetic.py ocr --out $(OCR_DATA) --num 4000 --charset digits --max-len 6 --seed 0 --overwrite

$(IMAGENET_DATA)/train.h5: | .venv-torch/.installed
	$(TORCH) scripts/make_synthetic.py imagenet --out $@ --num 2000 --classes 10 --seed 0 --overwrite

$(IMAGENET_DATA)/val.h5: | .venv-torch/.installed
	$(TORCH) scripts/make_synthetic.py imagenet --out $@ --num 400 --classes 10 --seed 1 --overwrite

data: $(OCR_DATA)/charset.txt $(IMAGENET_DATA)/train.h5 $(IMAGENET_DATA)/val.h5

# The main job: OCR smoke training on PaddlePaddle, CPU.
train-ocr: .venv-paddle/.installed $(OCR_DATA)/charset.txt
	$(PADDLE) -m train --config configs/ocr/smoke.yaml $(ARGS)

train-resnet50: .venv-torch/.installed $(IMAGENET_DATA)/train.h5 $(IMAGENET_DATA)/val.h5
	$(TORCH) -m train --config configs/resnet50/smoke.yaml $(ARGS)

doctor: .venv-paddle/.installed
	$(PADDLE) -m train.doctor --config $(or $(CONFIG),configs/ocr/smoke.yaml)

# Input-pipeline benchmark: each framework's part in its own env, merged into one report.
bench-quick: .venv-torch/.installed .venv-paddle/.installed
	$(TORCH) scripts/bench_loader.py --preset quick --out bench/results/quick-torch.json
	$(PADDLE) scripts/bench_loader.py --preset quick --out bench/results/quick-paddle.json
	$(TORCH) scripts/bench_loader.py --merge bench/results/quick-torch.json bench/results/quick-paddle.json --out bench/results/quick.json

bench: .venv-torch/.installed .venv-paddle/.installed
	$(TORCH) scripts/bench_loader.py --preset full --out bench/results/full-torch.json
	$(PADDLE) scripts/bench_loader.py --preset full --out bench/results/full-paddle.json
	$(TORCH) scripts/bench_loader.py --merge bench/results/full-torch.json bench/results/full-paddle.json --out bench/results/full.json

lint: .venv-torch/.installed
	.venv-torch/bin/ruff check .
	.venv-torch/bin/ruff format --check .

format: .venv-torch/.installed
	.venv-torch/bin/ruff check --fix .
	.venv-torch/bin/ruff format .

# Framework-free tests run in both envs; framework tests in their own env. TEST_FRAMEWORK makes
# a framework test that cannot import its framework fail instead of skipping.
test: setup lint
	$(MAKE) test-torch
	$(MAKE) test-paddle

test-torch: .venv-torch/.installed
	TEST_FRAMEWORK=torch $(TORCH) -m pytest -m "not paddle" $(PYTEST_ARGS)

test-paddle: .venv-paddle/.installed
	TEST_FRAMEWORK=paddle $(PADDLE) -m pytest -m "not torch" $(PYTEST_ARGS)

# Build both images on CPU stand-in bases with podman, run their smoke tests and train-ocr
# through compose.yaml (what CI does; needs root, installs podman itself).
containers-ci:
	bash scripts/ci_containers.sh

clean-venvs:
	rm -rf .venv-paddle .venv-torch
