# `make demo` and `make test` set up their environment first: the active virtual environment if
# there is one, else ./.venv. Torch comes from the CPU build on the local disk (torch==2.13.0)
# unless the environment already has a torch.
PYTHON ?= python3
ifdef VIRTUAL_ENV
  PY := python
else
  PY := .venv/bin/python
endif
ENV_DIR := $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
ENV_STAMP := $(ENV_DIR)/.pithtrain-env
TEST_STAMP := $(ENV_DIR)/.pithtrain-test

.PHONY: demo test env test-env clean

env: $(ENV_STAMP)
test-env: $(TEST_STAMP)

$(ENV_STAMP): pyproject.toml
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x .venv/bin/python ]; then $(PYTHON) -m venv .venv; fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	@touch $@

$(TEST_STAMP): $(ENV_STAMP)
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

demo: env
	$(PY) -m pithtrain demo

test: test-env
	$(PY) -m pytest -q

clean:
	rm -rf runs .pytest_cache
