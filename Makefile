# Two commands do all the set-up on a fresh machine (see README.md):
#   make demo   - creates .venv, installs the pinned CPU set, builds the fused CPU kernels, runs the main job
#   make test   - creates .venv if needed, runs the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint format wheel-smoke bench-tensor gpu-check install clean

$(STAMP): pyproject.toml requirements/cpu.txt third_party/fbgemm-gpu-shim/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/cpu.txt
	$(PY) -m pip install --quiet -e ".[dev,baselines]"
	$(PY) -m comera_rec.tensor.kernels comera_rec.dlrm.interaction_kernel comera_rec.integration.rowwise_bag_kernel comera_rec.dlrm.serving_ops  # the fused CPU kernels (1-3 min, once per machine), not in a training step
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) launch/train_dlrm.py --config configs/dlrm_demo.yaml $(ARGS)

bench-tensor: $(STAMP)
	$(PY) launch/bench_tensor.py $(ARGS)

# two pytest workers (pytest-xdist: the multi-process tests wait on launches and signals much of
# their time), a test file's tests on one worker (loadfile: a module-scoped fixture runs once;
# loadgroup's xdist_group marks are ignored under pytest 9). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=20 $(ARGS)

# on a CUDA machine: versions, GPUs, the GPU tests, a short DLRM benchmark, one table (docs/gpu.md); on CPU one line, exit 0
gpu-check: $(STAMP)
	$(PY) -m comera_rec.gpu_check $(ARGS)

# formatting and lint as configured in pyproject.toml ([tool.ruff]); `make format` rewrites
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# the built wheel in a fresh venv over the CPU set: console scripts, a short demo (CI runs it)
wheel-smoke: $(STAMP)
	PY=$(abspath $(PY)) bash .ci/wheel_smoke

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
