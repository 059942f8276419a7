"""The benchmarks' results sections name the code they measured (``benchmarks.write_section``)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import benchmarks


def _git(cwd, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_section_names_its_commit_and_says_when_the_tree_had_changes(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    (repo / "BENCHMARKS.md").write_text("# Benchmarks\n")
    _git(repo, "add", "code.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    commit = _git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.setattr(benchmarks, "ROOT", repo)

    out = tmp_path / "results" / "x.md"
    out.parent.mkdir()
    benchmarks.write_section(out, "## X\n\n| a |\n")
    text = out.read_text()
    assert text.startswith("## X\n\n| a |\n\nMeasured at commit ") and f"commit {commit}, " in text
    assert "uncommitted" not in text
    _git(repo, "add", "BENCHMARKS.md")  # tracked, as results are
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    commit = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "BENCHMARKS.md").write_text("rewritten by a benchmark\n")
    assert benchmarks.provenance().startswith(f"commit {commit}, ")  # a benchmark's output is not code
    (repo / "code.py").write_text("x = 2\n")
    assert f"commit {commit} + uncommitted changes, " in benchmarks.provenance()
    monkeypatch.setattr(benchmarks, "ROOT", tmp_path / "results")  # not a checkout
    assert benchmarks.provenance().startswith("commit unknown (not a git checkout)")
