# gradsync: every target sets itself up. `make test` and `make demo` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Development pins the CPU wheel that lies on these machines; pyproject.toml states the real range.
TORCH_PIN := torch==2.13.0

.PHONY: test demo lint bench docs clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet $(TORCH_PIN) -e '.[dev,frameworks,ft,docs]'
	touch $@

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks conftest.py docs/conf.py
	$(VENV)/bin/mypy src

test: $(VENV)/.installed lint
	$(VENV)/bin/pytest -q

# The documentation site: warnings are errors, nothing is fetched (docs/conf.py).
docs: $(VENV)/.installed
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

demo: $(VENV)/.installed
	$(VENV)/bin/gradsync demo

bench: $(VENV)/.installed
	$(PY) benchmarks/hook_overhead.py
	$(PY) benchmarks/step_time.py
	cd benchmarks && ../$(PY) comm_hooks.py && ../$(PY) observability_overhead.py

clean:
	rm -rf $(VENV) build docs/_build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
