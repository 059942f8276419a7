"""The content-addressed store: keys, atomic production, cache hits, corruption, concurrency."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import atomic_write_text, sha256_file
from qerl.pipeline.store.manifest import BuildResult, Manifest


def _writer(text: str, calls: list[str] | None = None):
    def build(out: Path) -> BuildResult:
        if calls is not None:
            calls.append(text)
        (out / "sub").mkdir()
        (out / "a.txt").write_text(text)
        (out / "sub" / "b.bin").write_bytes(b"\x00\x01" * 1000)
        return BuildResult(mode="test", metrics={"n": 2})

    return build


def test_key_depends_on_everything():
    key = ArtifactStore.key
    base = key("s", {"a": 1}, {"x": "d1"}, "c1")
    assert base == key("s", {"a": 1}, {"x": "d1"}, "c1")
    assert len({base, key("t", {"a": 1}, {"x": "d1"}, "c1"), key("s", {"a": 2}, {"x": "d1"}, "c1"),
                key("s", {"a": 1}, {"x": "d2"}, "c1"), key("s", {"a": 1}, {"x": "d1"}, "c2")}) == 5  # fmt: skip


def test_produce_then_hit(tmp_path):
    store = ArtifactStore(tmp_path)
    calls: list[str] = []
    m1, cached1 = store.produce("demo", {"a": 1}, {}, "v1", _writer("hello", calls))
    m2, cached2 = store.produce("demo", {"a": 1}, {}, "v1", _writer("hello", calls))
    assert (cached1, cached2) == (False, True) and calls == ["hello"]
    assert m1.digest == m2.digest and m2.mode == "test" and m2.metrics == {"n": 2}
    assert m2.file("a.txt").read_text() == "hello"
    assert m2.files["sub/b.bin"].sha256 == sha256_file(m2.dir / "sub" / "b.bin")
    assert Manifest.load(m2.dir).key == m1.key
    assert not any((tmp_path / "tmp").iterdir())


def test_failed_build_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)

    def boom(out: Path) -> None:
        (out / "partial.txt").write_text("x")
        raise RuntimeError("died")

    with pytest.raises(RuntimeError):
        store.produce("demo", {}, {}, "v1", boom)
    assert store.get("demo", store.key("demo", {}, {}, "v1")) is None
    assert not any((tmp_path / "tmp").iterdir())


def test_corruption_detected_and_recomputed(tmp_path):
    store = ArtifactStore(tmp_path)
    calls: list[str] = []
    m, _ = store.produce("demo", {}, {}, "v1", _writer("hello", calls))
    path = m.file("a.txt")
    path.write_text("HELLO")  # same size, new mtime
    assert store.problems(m) == ["a.txt: sha256 mismatch"]
    m2, cached = store.produce("demo", {}, {}, "v1", _writer("hello", calls))
    assert not cached and calls == ["hello", "hello"] and m2.file("a.txt").read_text() == "hello"
    (m2.dir / "sub" / "b.bin").unlink()
    assert store.get("demo", m2.key) is None


def test_full_verify_catches_same_mtime_tamper(tmp_path):
    store = ArtifactStore(tmp_path)
    m, _ = store.produce("demo", {}, {}, "v1", _writer("hello"))
    path = m.file("a.txt")
    stat = path.stat()
    path.write_text("jello")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert store.get("demo", m.key) is not None  # the fast check cannot see it
    assert store.get("demo", m.key, verify="full") is None


def _race(root: str, marker: str) -> None:
    store = ArtifactStore(root)

    def slow(out: Path) -> BuildResult:
        with open(marker, "a") as fh:
            fh.write("x")
        time.sleep(0.5)
        (out / "a.txt").write_text("same")
        return BuildResult()

    store.produce("race", {}, {}, "v1", slow)


def test_two_processes_same_key(tmp_path):
    marker = tmp_path / "builds.txt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_race, args=(str(tmp_path / "store"), str(marker))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert marker.read_text() == "x"  # built once; the second process found the first's result


def test_atomic_write_and_code_version(tmp_path):
    target = tmp_path / "f.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]
    mod = tmp_path / "stage.py"
    mod.write_text("x = 1\n")
    v1 = code_version(mod)
    mod.write_text("x = 2\n")
    assert code_version(mod) != v1


def test_source_digest_memo(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(b"abc")
    d1 = store.source_digest(src)
    assert store.source_digest(src) == d1
    (src / "w.bin").write_bytes(b"abd")
    assert store.source_digest(src) != d1
