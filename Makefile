# The two commands a newcomer needs: `make demo` and `make test`.
# Each bootstraps .venv (pinned stack, modelshard editable) on first use; `make test` also
# .venv-floor (the oldest supported versions: pyproject's floors, requirements/floor.txt).
VENV := .venv
PY := $(VENV)/bin/python

# What runs on the floor stack: the journey matrix and the examples (wherever the test tree
# keeps them), about a minute on an idle machine.
FLOOR_TESTS = $(wildcard tests/journeys/test_journeys.py tests/project/test_examples.py tests/test_examples.py)

.PHONY: demo test test-floor test-fast lint typecheck docs slow bench env env-floor clean

env:
	@bash scripts/bootstrap.sh

env-floor:
	@bash scripts/bootstrap.sh floor

demo: env
	$(PY) examples/demo.py

lint: env
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks

typecheck: env
	$(PY) -m pyright

docs: env
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir $(VENV)/site

# Tests run in two pytest-xdist workers (CI has two cores). A file whose module fixtures
# start processes (the journey matrix, the examples) is one xdist_group: one worker runs it.
XDIST = -n 2 --dist loadgroup

# The full suite: lint, types, strict docs build, every test on the lock, then the floor subset.
test: lint typecheck docs
	bash scripts/pytest.sh $(XDIST)
	$(MAKE) test-floor

# The journey matrix and the examples on the oldest supported versions.
test-floor: env-floor
	VENV=.venv-floor bash scripts/pytest.sh $(XDIST) -q -p no:cacheprovider $(FLOOR_TESTS)

test-fast: env
	bash scripts/pytest.sh -x -q

slow: env
	bash scripts/pytest.sh -m slow

bench: env
	$(PY) benchmarks/expand.py

clean:
	rm -rf $(VENV) .venv-floor site .pytest_cache
