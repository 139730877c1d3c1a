# Hindsight: `make run` serves the embedded stack, `make test` runs the whole suite.
# Both create .venv and install everything they need on a fresh clone.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8700
DATA_DIR ?= ./hindsight-data
PYTEST_ARGS ?=
# Python 3.11 formats a traceback's ^^^ markers with ast.parse, whose state is shared between
# threads (CPython gh-106905): a server thread logging an exception while another thread
# parses can raise "SystemError: AST constructor recursion depth mismatch" in either. Tests
# run without the column tables, so tracebacks never parse.
PYTEST := PYTHONNODEBUGRANGES=1 $(BIN)/python -m pytest

.PHONY: install browser run test test-slow test-compose lint format schema bench dist clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[server,dask,test]'
	@touch $(STAMP)

## install: create .venv with the SDK, the services, the test tools and the `hindsight` command
install: $(STAMP)

## browser: Debian's Chromium for the dashboard tests; where it cannot be installed the
## browser tests are skipped and say why (Playwright's own browser download never works here)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser tests ..."; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
	      || echo "NOTE: could not install chromium: the browser tests will be skipped"; \
	  else echo "NOTE: chromium is not installed and cannot be installed here: the browser tests will be skipped"; fi; }

## run: the embedded server (collector + query, SQLite + local blobs) on http://$(HOST):$(PORT)
run: install
	$(BIN)/hindsight serve --data-dir $(DATA_DIR) --host $(HOST) --port $(PORT)

## test: lint, then every test but the slow fault/flood runs
test: install lint browser
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

## test-slow: the long fault, flood and scale runs
test-slow: install
	$(PYTEST) -m slow $(PYTEST_ARGS)

## test-compose: the full stack under docker compose for real (slow; root on Debian): installs
## docker.io, docker-compose and debootstrap where missing, starts dockerd, builds the images
## locally when no registry answers (docker/prepare.sh), then tests/compose/ brings the stack up
## from docker-compose.yml with the README's commands, records real Dask runs through it, kills
## the collector and Postgres under a live run, scales the collector, and prints its figures
COMPOSE_ENV ?= test-artifacts/compose/images.env
test-compose: install browser
	HINDSIGHT_PYTHON=$(BIN)/python ./docker/prepare.sh $(COMPOSE_ENV)
	HINDSIGHT_COMPOSE_ENV=$(COMPOSE_ENV) $(PYTEST) -m compose tests/compose $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## schema: regenerate docs/schema/batch-v1.json from hindsight/schema.py
schema: install
	$(BIN)/python -c "import json; from hindsight.schema import json_schema; \
	open('docs/schema/batch-v1.json', 'w').write(json.dumps(json_schema(), indent=2) + '\n')"

## bench: every benchmark (minutes each; prints figures and a JSON line per bench)
bench: install
	@for b in bench/[a-z]*.py; do name=$$(basename $$b .py); case $$name in lib_*) continue;; esac; echo "== $$name"; $(BIN)/python -m bench.$$name || exit 1; done

## dist: a wheel of the SDK alone (agent, client, schema; no server dependencies) in dist/,
## for Dask worker images: pip install dist/hindsight_sdk-*.whl
dist: install
	rm -rf build/sdk && mkdir -p build/sdk dist
	cp -r hindsight build/sdk/hindsight && cp docker/sdk.pyproject.toml build/sdk/pyproject.toml
	find build/sdk -name __pycache__ -prune -exec rm -rf {} +
	$(BIN)/python -m pip wheel --quiet --no-deps -w dist build/sdk

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
