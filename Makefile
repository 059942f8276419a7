# Two entry points; each creates .venv on first use (scripts/bootstrap.sh).
.PHONY: demo test lint bench venv docs
venv:
	@scripts/bootstrap.sh

demo: venv
	.venv/bin/qerl run

test: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
	.venv/bin/python -m pytest -q

bench: venv
	.venv/bin/qerl bench

# The docs site (mkdocs.yml, docs/) into site/; `make test` builds it too (--strict: broken links fail).
docs: venv
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
