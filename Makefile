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

# The full suite. First lint. Then three jobs side by side: pyright, every test on the lock
# (the strict docs build among them: tests/project/test_docs.py builds the site and reads its
# HTML), and the floor environment then the floor subset on the oldest versions, one test at
# a time. The main suite, the longest, starts at once: it does not wait for the floor
# environment to be made. Its workers spend much of their time waiting on the processes they
# start; pyright and the floor environment's making run at the lowest priority, on the CPU
# the main suite leaves, and end long before it. (The floor tests do not: their processes
# have timeouts.) The other two jobs' output follows the main suite's.
FLOOR_RUN = VENV=.venv-floor bash scripts/pytest.sh -q -p no:cacheprovider $(FLOOR_TESTS)
IDLE = nice -n 19

test: env
	$(MAKE) --no-print-directory lint
	bash scripts/alongside.sh "$(IDLE) $(PY) -m pyright" \
	  "$(IDLE) $(MAKE) --no-print-directory env-floor && $(FLOOR_RUN)" \
	  -- bash scripts/pytest.sh $(XDIST)

# The journey matrix and the examples on the oldest supported versions.
test-floor: env-floor
	$(FLOOR_RUN) $(XDIST)

test-fast: env
	bash scripts/pytest.sh -x -q

slow: env
	bash scripts/pytest.sh -m slow

bench: env
	$(PY) benchmarks/expand.py

clean:
	rm -rf $(VENV) .venv-floor site .pytest_cache
