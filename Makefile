# k3forge: `make gate` and `make test` are the two commands a newcomer types (see README).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU machines carry a local CPU build of exactly this torch; an unpinned torch pulls a CUDA build.
TORCH_CPU := torch==2.13.0
WHEELHOUSE := .wheelhouse
# Both test environments install every package at the version CI last passed with, so a new release upstream
# cannot change what CI runs. (transformers >= 5.25 depends on HF's `kernels`, an import name that our
# toolkit's directory shadows from the checkout: compressed-tensors' import of transformers then fails.)
CONSTRAINTS      := -c .ci/constraints.txt
VLLM_CONSTRAINTS := -c .ci/constraints-vllm.txt
# cp312 manylinux wheels of the pinned GPU extras, for GPU runners without a package index.
WHEEL_PLATFORM := --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64
# The pinned GPU extras, plus what the gate and its evals need that the GPU image lacks.
GPU_WHEELS := nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
	nvidia-cutlass-dsl-libs-cu13==4.8.1 fla-core==0.6.0 humming-kernels==0.1.20 flash-attn-res==0.1.12 \
	pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
	gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3 \
	llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
	attrs==26.1.0

.PHONY: install test gate bench wheelhouse clean

$(STAMP): pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q $(CONSTRAINTS) -e '.[gpu,test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q
	$(MAKE) --no-print-directory test-vllm

# GPU runners have no package index. On a runner (its own Python has CUDA torch) where `make wheelhouse` left
# wheels (.wheelhouse/all), the gate installs them, and nothing else, into a venv that sees the runner's torch,
# and runs from the checkout; everywhere else it runs from the installed venv.
GATE_WHEELS := $(wildcard $(WHEELHOUSE)/all/*.whl)
CUDA_TORCH := $(PYTHON) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null

gate:
	@if [ -n "$(GATE_WHEELS)" ] && $(CUDA_TORCH); then \
		$(MAKE) --no-print-directory $(VENV)/.installed-wheelhouse && $(BIN)/python -m gates.cli gate; \
	else \
		$(MAKE) --no-print-directory install && $(BIN)/k3forge gate; \
	fi

$(VENV)/.installed-wheelhouse: $(GATE_WHEELS)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --no-index --no-deps $(GATE_WHEELS)
	touch $@

bench: $(STAMP)
	$(BIN)/k3forge bench

# One device call carries at most 64 MiB with the tree (~28 MB with the trained checkpoint): the compiler wheel
# travels in three parts (a, b, and c with every other wheel); the mini-K3's training needs c only. small holds
# every wheel but the compiler's (~8 MB): enough for the gate's own checks on a GPU (`gpu_session.sh wall`).
wheelhouse:
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)/all $(WHEELHOUSE)/a $(WHEELHOUSE)/b $(WHEELHOUSE)/c \
		$(WHEELHOUSE)/small
	$(PYTHON) -m pip download --no-deps $(WHEEL_PLATFORM) -d $(WHEELHOUSE)/all $(GPU_WHEELS)
	cd $(WHEELHOUSE)/all && for w in *.whl; do \
		if [ $$(stat -c %s $$w) -gt 32000000 ]; then split -n 3 -d $$w ../a/$$w.part && echo 3 > ../c/$$w.parts; \
		else cp $$w ../c/; fi; done
	mv $(WHEELHOUSE)/a/*.part01 $(WHEELHOUSE)/b/ 2>/dev/null || true
	mv $(WHEELHOUSE)/a/*.part02 $(WHEELHOUSE)/c/ 2>/dev/null || true
	cp $(WHEELHOUSE)/c/*.whl $(WHEELHOUSE)/small/ && rm -f $(WHEELHOUSE)/small/nvidia_cutlass*
	@ls -la $(WHEELHOUSE)/a $(WHEELHOUSE)/b $(WHEELHOUSE)/c $(WHEELHOUSE)/small

clean:
	rm -rf $(VENV) $(WHEELHOUSE) .pytest_cache

# ---- The vLLM plugin (model/kimi_k3/vllm/) runs in its own environment: vLLM's pins clash with ours (README). ----
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
# PyPI's builds of these link a CUDA torch and break `import vllm` beside the CPU torch; K3 is text-only here.
VLLM_UNUSED := torchvision torchaudio torchcodec

.PHONY: install-vllm test-vllm clean-vllm

$(VLLM_STAMP): pyproject.toml model/kimi_k3/vllm/requirements.py .ci/constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(TORCH_CPU)
	$(VLLM_BIN)/python model/kimi_k3/vllm/requirements.py > $(VLLM_VENV)/requirements.txt
	$(VLLM_BIN)/pip install -q $(VLLM_CONSTRAINTS) -r $(VLLM_VENV)/requirements.txt
	$(VLLM_BIN)/pip uninstall -q -y $(VLLM_UNUSED)
	$(VLLM_BIN)/pip install -q --no-deps -e .
	touch $@

install-vllm: $(VLLM_STAMP)

# The plugin's tests against the real vLLM engine (part of `make test`).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/pytest -q tests/vllm

clean: clean-vllm
clean-vllm:
	rm -rf $(VLLM_VENV)
