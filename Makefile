# Every target sets itself up: a fresh machine needs only python3 (>= 3.10).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kerasfeed-installed
# A second environment without TensorFlow (JAX backend only, and the remote extra), for the tests
# that train through kerasfeed.to_loader where TensorFlow cannot be imported.
NOTF_VENV ?= .venv-notf
NOTF_STAMP := $(NOTF_VENV)/.kerasfeed-installed

.PHONY: demo test keras-matrix bench bench-fit bench-cache bench-backends bench-gpu soak-ctrl-c clean

# First run only (later runs find $(STAMP) and start at once): says what it
# does and shows pip's progress, since it downloads about 1.7 GB.
$(STAMP): setup.cfg setup.py
	@echo "kerasfeed set-up: creating $(VENV)/ and installing kerasfeed with TensorFlow (CPU), Keras, h5py"
	@echo "and the test tools (the dev extra). About 1.7 GB to download: a minute or two. Only the first run does this."
	@$(PYTHON) -c "import shutil; free = shutil.disk_usage('.').free / 2**30; free < 6 and print(f'kerasfeed set-up: WARNING: {free:.1f} GB free on this disk; the two environments take about 4.6 GB and pip needs more while it unpacks')"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --disable-pip-version-check --progress-bar on -e ".[dev]"
	@TMPDIR=$(VENV) $(PY) -m ipykernel install --sys-prefix --name python3 > /dev/null  # its empty scratch folder stays in the venv
	@touch $(STAMP)
	@echo "kerasfeed set-up done."

$(NOTF_STAMP): setup.cfg setup.py
	$(PYTHON) -m venv $(NOTF_VENV)
	$(NOTF_VENV)/bin/python -m pip install --quiet -e ".[jax,remote]"
	touch $(NOTF_STAMP)

demo: $(STAMP)
	$(PY) -m kerasfeed demo

# Two test processes (pytest-xdist): most tests wait on the processes they start, so two run at once.
# 11 min 41 s on a quiet 2-core AMD EPYC on 2026-11-26; 20-24 min on the same VM on slower days.
# A targeted run needs no -n (e.g. `.venv/bin/python -m pytest tests/test_mix.py`).
test: $(STAMP) $(NOTF_STAMP)
	KERASFEED_NOTF_PYTHON=$(NOTF_VENV)/bin/python $(PY) -m pytest -q -n 2 --dist worksteal

# The Keras-facing tests on every Keras minor release setup.cfg accepts, one at a time in a light venv
# each (tests/keras_matrix.py; ~10 minutes a version, not part of `make test`): docs/keras_versions.md.
keras-matrix: $(STAMP) $(NOTF_STAMP)
	$(PY) tests/keras_matrix.py --notf $(NOTF_VENV)/bin/python

bench: $(STAMP)
	$(PY) benchmarks/run.py

bench-fit: $(STAMP)
	$(PY) benchmarks/fit.py

# The item cache: pass 0 against uncached, a kept directory's second run, one store per host (benchmarks/cache.py).
bench-cache: $(STAMP)
	$(PY) benchmarks/cache.py

bench-backends: $(STAMP)
	$(PY) benchmarks/backends.py

# The GPU machine's benchmark (no TensorFlow needed; PyTorch and Grain rows need their packages).
bench-gpu: $(STAMP)
	KERAS_BACKEND=jax $(PY) benchmarks/gpu.py --output-dir benchmarks/results/gpu

# Ctrl-C during fit never hangs: SIGINT to the process group of a training script (model.fit over
# worker processes) at a random moment, RUNS times beside BURNERS busy loops (not part of `make test`,
# which runs three of them). About 20-40 minutes on 2 cores; hung runs' stacks go to /tmp/kerasfeed-ctrl-c.
RUNS ?= 300
BURNERS ?= 2
soak-ctrl-c: $(STAMP)
	$(PY) benchmarks/ctrl_c.py --runs $(RUNS) --burners $(BURNERS)

clean:
	rm -rf $(VENV) $(NOTF_VENV) build *.egg-info
