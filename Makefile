# Two entry points; each creates .venv on first use (scripts/bootstrap.sh).
# The suite runs in TEST_WORKERS pytest-xdist workers (make test TEST_WORKERS=4 on a bigger machine), the
# slowest files first (tests/conftest.py's SLOW_FILES; --no-loadscope-reorder keeps that order).
TEST_WORKERS ?= 2
.PHONY: demo test test-kit test-fleet test-soak lint bench venv docs
venv:
	@scripts/bootstrap.sh

demo: venv
	.venv/bin/qerl run

test: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not kit and not fleet"

# The GPU kit's slow CPU checks (dry runs of scripts/gpu/ and tools/gpu_transfer/ on the CPU, the
# replica's model and weights checks); CI runs them after `make test`.
test-kit: venv
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m kit

# The fleet suite (tests/fleet/): it starts real PostgreSQL, Prefect, MLflow and S3 (SeaweedFS) servers
# on loopback and several workers with logical GPU ids, one test at a time; CI runs it after test-kit.
test-fleet: venv
	.venv/bin/python -m pip install -q -r requirements/fleet.txt >> .venv/bootstrap.log 2>&1
	.venv/bin/python -m pytest -q -p no:xdist -m fleet tests/fleet --ignore=tests/fleet/test_soak.py

# The short soak (benchmarks/soak.py): three nights on the fleet, one fault each, every invariant
# checked after every night against the same nights on one machine; CI runs it after test-fleet.
test-soak: venv
	.venv/bin/python -m pip install -q -r requirements/fleet.txt >> .venv/bootstrap.log 2>&1
	.venv/bin/python -m pytest -q -p no:xdist -m fleet tests/fleet/test_soak.py

bench: venv
	.venv/bin/qerl bench

# The docs site (mkdocs.yml, docs/) into site/; `make test` builds it too (--strict: broken links fail).
docs: venv
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
