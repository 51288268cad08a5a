# Every target creates .venv when it is missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench serve clean
RUN ?= runs/demo

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq -e '.[test]'
	touch $(STAMP)

# Two workers, each given whole files (module fixtures are built once), the slowest files
# first (tests/conftest.py): most tests wait on subprocesses, sockets or one core, so two at
# once take about 60% of the serial time.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

demo: $(STAMP)
	$(PY) scripts/pipeline.py --data synthetic --out $(RUN) --overwrite

bench: $(STAMP)
	$(PY) scripts/benchmark.py

serve: $(STAMP)
	$(PY) scripts/serve.py --port=8500 --rest_api_port=8501 --model_config_file=$(RUN)/export/models_scann.config

clean:
	rm -rf $(VENV) build *.egg-info
