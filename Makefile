# The two commands a newcomer needs: `make demo` and `make test`.
# Each bootstraps .venv (pinned stack, modelshard editable) on first use.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast lint typecheck docs slow bench env clean

env:
	@bash scripts/bootstrap.sh

demo: env
	$(PY) examples/demo.py

lint: env
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks

typecheck: env
	$(PY) -m pyright

docs: env
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir $(VENV)/site

# The full suite: lint, types, strict docs build, then every test.
test: lint typecheck docs
	bash scripts/pytest.sh

test-fast: env
	bash scripts/pytest.sh -x -q

slow: env
	bash scripts/pytest.sh -m slow

bench: env
	$(PY) benchmarks/expand.py

clean:
	rm -rf $(VENV) site .pytest_cache
