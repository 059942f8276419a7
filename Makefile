# Two entry points; each creates .venv on first use (scripts/bootstrap.sh).
.PHONY: demo test lint bench venv
venv:
	@scripts/bootstrap.sh

demo: venv
	.venv/bin/qerl run

test: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -q

bench: venv
	.venv/bin/qerl bench
