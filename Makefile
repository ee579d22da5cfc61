# Everyday commands (CONTRIBUTING.md). CI runs .ci/run: the set-up, ruff, then the README's test command.
PYTHON ?= python
PYTEST ?= $(PYTHON) -m pytest

.PHONY: help install lint format test-fast test bench-smoke ci

help:
	@echo "make install      torch (CPU, pinned) first, then kvferry with the test extra (editable)"
	@echo "make lint         ruff check + ruff format --check (what CI runs before the suite)"
	@echo "make format       ruff format + ruff check --fix"
	@echo "make test-fast    the quick run: pytest -m 'not slow' (unit and parity, no clusters)"
	@echo "make test         the whole suite, as CI runs it"
	@echo "make bench-smoke  a short benchmark on a local cluster of the tiny model (~1 min)"
	@echo "make ci           .ci/run: what CI runs on a clean clone"

install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[test]"

lint:
	ruff check .
	ruff format --check .

format:
	ruff format .
	ruff check --fix .

test-fast:
	$(PYTEST) -m "not slow"

test:
	$(PYTEST)

# bench/http_overhead.py: redis, a pool node, a prefill and a decode worker and the router with its HTTP
# API (the tiny model), the same greedy requests through gRPC and the OpenAI API; one JSON line
bench-smoke:
	$(PYTHON) bench/http_overhead.py --model tiny --requests 8 --tokens 32

ci:
	bash .ci/run
