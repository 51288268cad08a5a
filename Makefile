# Every target creates .venv when it is missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench serve clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) scripts/pipeline.py --data synthetic --out runs/demo

bench: $(STAMP)
	$(PY) scripts/benchmark.py

clean:
	rm -rf $(VENV) build *.egg-info
