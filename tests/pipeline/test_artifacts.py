"""The content-addressed store: keys, atomic production, cache hits, corruption, concurrency."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import atomic_write_text, read_json, sha256_file
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
    assert store.get("demo", m.key, verify="fast") is not None  # the stat-only check cannot see it
    assert store.get("demo", m.key, verify="full") is None


def test_a_same_size_same_mtime_change_is_caught_by_default_and_rebuilt(tmp_path, monkeypatch):
    """A flipped byte that keeps size and mtime used to be served as cached unless QERL_VERIFY=full:
    the next run's store hashes what it looks up once, finds it, moves it aside and rebuilds it."""
    from qerl.pipeline.store import integrity

    monkeypatch.delenv("QERL_VERIFY", raising=False)
    calls: list[str] = []
    m, _ = ArtifactStore(tmp_path).produce("train", {}, {}, "v1", _writer("hello", calls))
    path = m.dir / "sub" / "b.bin"
    stat = path.stat()
    with open(path, "r+b") as fh:  # flip one byte in place: same size, same inode
        fh.seek(7)
        byte = fh.read(1)
        fh.seek(7)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    night = ArtifactStore(tmp_path)  # the next night: a new process, a new store object
    hashed: list[str] = []
    monkeypatch.setattr(integrity, "sha256_file", lambda p: hashed.append(Path(p).name) or sha256_file(p))
    m2, cached = night.produce("train", {}, {}, "v1", _writer("hello", calls))
    assert not cached and calls == ["hello", "hello"]  # detected, moved aside, rebuilt: healed
    assert sha256_file(m2.dir / "sub" / "b.bin") == m2.files["sub/b.bin"].sha256
    assert any(p.name.startswith(m.key) for p in (tmp_path / "trash").iterdir())  # the corrupt copy
    # a file is hashed once per store object: later lookups compare its stat with what was hashed
    hashed.clear()
    assert night.get("train", m2.key) is not None and night.get("train", m2.key) is not None
    assert sorted(hashed) == ["a.txt", "b.bin"]
    assert night.get("train", m2.key, verify="full") is not None and len(hashed) == 4
    with pytest.raises(ValueError, match="QERL_VERIFY='sometimes'"):
        night.get("train", m2.key, verify="sometimes")


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
    d2 = store.source_digest(src)
    assert d2 != d1
    memo = store.root / "digests.json"
    memo.write_text('{"cut off')  # damaged outside qerl: a memo starts again, the digest is the same
    assert store.source_digest(src) == d2 and read_json(memo)[str(src.resolve())]["digest"] == d2


def test_read_json_names_the_file_it_cannot_parse(tmp_path):
    path = tmp_path / "record.json"
    path.write_text('{"a": 1}')
    assert read_json(path) == {"a": 1}
    for damaged in (b'{"a": ', b"\xff\xfe"):
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match=f"{path} cannot be read as JSON"):
            read_json(path)


def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_write_names_the_path_and_keeps_the_old_file(tmp_path, monkeypatch):
    from qerl.pipeline.store import files

    target = tmp_path / "run.json"
    atomic_write_text(target, "old")
    monkeypatch.setattr(files.os, "fsync", _no_space)
    with pytest.raises(files.DiskFullError) as err:
        atomic_write_text(target, "x" * 5000)
    text = str(err.value)
    assert "\n" not in text and str(target) in text and "needs 5.0 KB" in text and "free there" in text
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_disk_full_build_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    from qerl.flows import cli
    from qerl.pipeline.store.files import DiskFullError

    store = ArtifactStore(tmp_path)

    def build(out: Path) -> BuildResult:
        (out / "adapter_model.safetensors").write_bytes(b"\x00" * 3000)
        _no_space()  # the next write finds the disk full (a library may wrap it: the cause counts)

    with pytest.raises(DiskFullError) as err:
        store.produce("train", {"a": 1}, {}, "v1", build)
    text = str(err.value)
    assert "the train artifact" in text and str(tmp_path / "tmp") in text and "more than 3.0 KB" in text
    assert not any((tmp_path / "tmp").iterdir()) and not (tmp_path / "objects" / "train").exists()
    m, cached = store.produce("train", {"a": 1}, {}, "v1", _writer("fine"))  # space freed: it builds
    assert not cached and m.file("a.txt").read_text() == "fine"

    def wrapped(out: Path) -> BuildResult:  # torch's writer quotes the errno in a RuntimeError
        try:
            _no_space()
        except OSError as cause:
            raise RuntimeError("[enforce fail] file write failed") from cause

    with pytest.raises(DiskFullError, match="it needs more than the disk had left"):  # nothing written yet
        store.produce("train", {"a": 2}, {}, "v1", wrapped)

    # the CLI prints it in one line (exit 2), no traceback
    from qerl.flows import store_commands

    monkeypatch.setattr(store_commands, "cmd_gc", lambda a: store.produce("train", {"a": 3}, {}, "v1", build))
    assert cli.main(["gc", "--work-dir", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and "no space left on device writing the train artifact" in out.err
