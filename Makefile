# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qreport-installed
# the optional extras CI installs so their tests run (EXTRAS=dev: without ExecuTorch and Model Explorer,
# whose tests then skip)
EXTRAS ?= dev,executorch,explorer,llamacpp,checkpoint,tasks

# llama-cpp-python builds llama.cpp from its source: the library only (no multimodal tools, no common
# utilities), for this machine's CPU (GGML_NATIVE, llama.cpp's default), as a llama.cpp user builds it
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_COMMON=OFF
LLAMA_WHEELS := $(VENV)/llama-wheels
comma := ,

.PHONY: setup test test-slow test-gpu demo bench lint clean

setup: $(STAMP)

# torch is installed first and pinned, with pip (which finds a CPU wheel in the find-links a machine's
# pip.conf names), so nothing later can pull a CUDA build from the index. The rest, pinned by
# constraints.txt beside the installed torch, goes in with uv (pinned there too): its parallel
# downloads, unpacking and bytecode compilation took 35 s where pip took about 150 s on 2 cores.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0 uv
	@# llama.cpp compiles (minutes, both cores) while uv downloads, unpacks and byte-compiles the rest
	rm -rf $(LLAMA_WHEELS); \
	if echo ',$(EXTRAS),' | grep -q ',llamacpp,'; then \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/python -m pip wheel -q --no-deps \
			-w $(LLAMA_WHEELS) $$(grep -i '^llama[-_]cpp[-_]python==' constraints.txt) & built=$$!; \
	fi; \
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -c constraints.txt -e '.[$(subst $(comma)llamacpp,,$(EXTRAS))]' || exit 1; \
	if [ -n "$$built" ]; then \
		wait $$built || exit 1; \
		$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -c constraints.txt $(LLAMA_WHEELS)/*.whl -e '.[$(EXTRAS)]' || exit 1; \
	fi
	touch $(STAMP)

# The tests whose outcome rests on the real kernels' arithmetic (marked `kernels`) run again: on one
# thread with torch's no-SIMD kernels and, on a CPU with AVX-512,
# as a CPU with AVX2 and no AVX-512 runs them (tools/without-avx512.env), so that an assumption true of
# one CPU or one thread count fails here first. On a CPU without AVX-512 the main suite already ran them
# as such a CPU does: that rerun would repeat it. Only the files that hold such tests are collected.
# Both reruns start beside the main suite at the lowest priority (nice 19): they take the cores the
# suite leaves idle (a worker waiting on a browser or a subprocess, the last file's tail) instead of
# running after it (the one-thread rerun took 50 s there, the AVX2 one 30 s).
WITHOUT_AVX512 := $(shell grep -v '^\#' tools/without-avx512.env)
HAS_AVX512 := $(shell grep -q -m1 avx512f /proc/cpuinfo 2>/dev/null && echo yes)
KERNEL_FILES := $(shell grep -l 'mark.kernels' tests/*.py)
# (the shortcuts are checked in the main suite's run of the decoder and XNNPACK files, tests/conftest.py
# CHECKED_FILES: not again here)
KERNEL_TESTS := env QREPORT_CHECK_SHORTCUTS=0 $(BIN)/python -m pytest -m 'kernels and not slow' -p no:cacheprovider $(KERNEL_FILES)
NO_SIMD_TESTS := nice -n 19 env ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 $(KERNEL_TESTS)
NO_SIMD_LOG := $(VENV)/kernel-tests-no-simd.log
WITHOUT_AVX512_LOG := $(VENV)/kernel-tests-without-avx512.log

# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file in one of them, so that
# ExecuTorch's lowering (one core, in Python) and the notebooks' kernels and browser overlap with the
# rest; each worker takes its share of the cores (tests/conftest.py). On 2 cores the main suite took
# 1,214 s in one process (browser tests left out), 860 s in three. Files go out in collection order, the
# longest first (tests/conftest.py, LONGEST_FIRST), not xdist's most-tests-first. The wall time is printed last.
TEST_WORKERS ?= 3

test: setup
	@began=$$(date +%s); \
	$(NO_SIMD_TESTS) > $(NO_SIMD_LOG) 2>&1 & no_simd=$$!; \
	if [ "$(HAS_AVX512)" = yes ]; then \
		nice -n 19 env $(WITHOUT_AVX512) $(KERNEL_TESTS) > $(WITHOUT_AVX512_LOG) 2>&1 & without=$$!; \
	fi; \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20; suite=$$?; \
	if [ "$(HAS_AVX512)" = yes ]; then \
		wait $$without; without_avx512=$$?; \
		echo "--- the tests marked kernels as a CPU with AVX2 and no AVX-512 runs them (beside the suite, at the lowest priority):"; \
		cat $(WITHOUT_AVX512_LOG); \
	else \
		echo "--- the tests marked kernels: this CPU has no AVX-512, so the suite above ran them as such a CPU does"; \
		without_avx512=0; \
	fi; \
	wait $$no_simd; one_thread=$$?; \
	echo "--- the same tests on one thread, torch's no-SIMD kernels (beside the suite, at the lowest priority):"; \
	cat $(NO_SIMD_LOG); \
	echo "--- make test: $$(( $$(date +%s) - began )) s wall (suite exit $$suite, kernels $$without_avx512 / $$one_thread)"; \
	test $$suite -eq 0 && test $$without_avx512 -eq 0 && test $$one_thread -eq 0

# the tests marked slow (pyproject.toml), left out of `make test` to keep it near 15 minutes on 2 cores
test-slow: setup
	$(BIN)/python -m pytest -m slow

# the tests marked gpu: the model on a CUDA GPU (a machine without one fails them, it does not skip them).
# Install a CUDA build of torch==2.13.0 in .venv first; the CPU wheel `make setup` pins has no CUDA.
test-gpu: setup
	$(BIN)/python -m pytest -m gpu

# the report in the terminal, then JupyterLab on the quickstart (127.0.0.1, no browser launched:
# the printed URL opens the quickstart notebook; works on a machine without a display). Ctrl-C stops the server.
DEMO_PORT ?= 8888
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
demo: setup
	$(BIN)/python -m qreport_widgets.demo
	cd notebooks && $(abspath $(BIN))/python -m jupyterlab --no-browser --ip=127.0.0.1 --port=$(DEMO_PORT) \
		$(ROOT_FLAG) --LabApp.default_url=/lab/tree/01_quickstart.ipynb

bench: setup
	$(BIN)/python benchmarks/run_all.py

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
