# Two entry points; each creates .venv on first use (scripts/bootstrap.sh).
# The suite runs in TEST_WORKERS pytest-xdist workers (make test TEST_WORKERS=4 on a bigger machine), the
# slowest files first (tests/conftest.py's SLOW_FILES; --no-loadscope-reorder keeps that order).
TEST_WORKERS ?= 2
.PHONY: demo test test-kit lint bench venv docs
venv:
	@scripts/bootstrap.sh

demo: venv
	.venv/bin/qerl run

test: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not kit"

# The GPU kit's slow CPU checks (dry runs of scripts/gpu/ and tools/gpu_transfer/ on the CPU, the
# replica's model and weights checks); CI runs them after `make test`.
test-kit: venv
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m kit

bench: venv
	.venv/bin/qerl bench

# The docs site (mkdocs.yml, docs/) into site/; `make test` builds it too (--strict: broken links fail).
docs: venv
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
