# Every target sets itself up: a fresh machine needs only python3 (>= 3.10).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kerasfeed-installed

.PHONY: demo test bench clean

$(STAMP): setup.cfg setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kerasfeed demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
