"""The base an evaluation serves: a model's quantized checkpoint and its twin, made by the stages.

Not a stage: a composition of the fetch, quantize and dequantize stages (each cached under its own
key) for ``qerl eval`` (``eval_base``), which serves a base given as a ``qerl quantize`` export, a plain model directory
or a store artifact holding one (``base_artifacts``), or, for a registered version, the exact
checkpoint that version trained on (``registered_base``): the one its lineage names by content
digest (``base_checkpoint``), found in the store, else rebuilt from the recorded recipe, data,
template and validation split (``qerl.pipeline.planning.registered.quantize_inputs``) and refused
when the rebuild's digest differs, naming both (a GPTQ base rebuilt on another device rounds its
last bits otherwise). A version registered before the lineage named its checkpoint is quantized by
its run's recipe, and said to be unverified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from qerl.pipeline.nvfp4.recipe import QuantizeConfig
from qerl.pipeline.planning.registered import RunProtocol, quantize_inputs
from qerl.pipeline.schemes import UNQUANTIZED_MODE
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.layout import MANIFEST, OBJECTS_DIR, QUANTIZE_STAGE
from qerl.pipeline.store.manifest import ArtifactError, Manifest
from qerl.stages import demo_base, dequantize, fetch_model, quantize

__all__ = ["base_artifacts", "eval_base", "find_checkpoint", "is_checkpoint", "registered_base"]

Progress = Callable[[int, int], None]


def is_checkpoint(base: str | Path) -> bool:
    """Whether ``base`` is a ``qerl quantize`` checkpoint (its manifest's stage), not a model to quantize."""
    path = Path(base)
    return (path / MANIFEST).is_file() and Manifest.load(path).stage == QUANTIZE_STAGE


def _twin(
    quantized: Manifest, store: ArtifactStore, need_twin: bool, twin_dtype: str | None
) -> Manifest | None:
    needed = need_twin and quantized.mode != UNQUANTIZED_MODE  # an unquantized base is served as it is
    return dequantize.run(QuantizeConfig(twin_dtype=twin_dtype), quantized, store) if needed else None


def base_artifacts(
    base: str | Path,
    store: ArtifactStore,
    need_twin: bool = True,
    recipe: QuantizeConfig | None = None,
    progress: Progress | None = None,
) -> tuple[Manifest, Manifest | None]:
    """(quantized, twin) for a base given as a ``qerl quantize`` export or as a plain HF model dir.

    An export carries its manifest: it is checked against its files and used as is (a ``recipe`` is
    then an error: the base is quantized already). A plain model directory is quantized with
    ``recipe`` (default: the default recipe; a cached stage, so a repeat is a lookup); so is a store
    artifact that is one (a catalogue model's ``fetch-model`` directory, which ``--base NAME``
    resolves to, or the ``demo-base``). The twin (what CPU serving needs) is derived through the
    dequantize stage, also cached. ``progress(done, total)``: the quantize's tensors, when it builds.
    """
    base = Path(base)
    if not base.is_dir():
        raise ArtifactError(f"--base {base} is not a directory")
    stage = Manifest.load(base).stage if (base / MANIFEST).is_file() else None
    if stage == QUANTIZE_STAGE:
        quantized = Manifest.load(base)
        if recipe is not None:
            raise ArtifactError(
                f"--base {base} is a quantized checkpoint (method {quantized.config.get('method', 'rtn')}); "
                "quantize.* settings apply to a model to quantize: pass its HF directory or catalogue name"
            )
        bad = store.problems(quantized)
        if bad:
            raise ArtifactError(f"{base} does not match its manifest: {'; '.join(bad)}")
        return quantized, _twin(quantized, store, need_twin, None)
    if stage not in (None, fetch_model.STAGE, demo_base.STAGE):
        raise ArtifactError(
            f"{base} holds a '{stage}' artifact, not a model: pass a '{QUANTIZE_STAGE}' checkpoint, "
            "a HF model directory or a catalogue name"
        )
    qcfg = recipe or QuantizeConfig()
    quantized = quantize.run(qcfg, base, store, progress=progress)
    return quantized, _twin(quantized, store, need_twin, qcfg.twin_dtype)


def find_checkpoint(store: ArtifactStore, digest: str) -> Manifest | None:
    """The store's whole quantize artifact whose content digest is ``digest``; None if it has none."""
    root = store.root / OBJECTS_DIR / QUANTIZE_STAGE
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            found = Manifest.load(directory)
        except (OSError, ValueError, ArtifactError):
            continue
        if found.digest == digest and not found.pruned and not store.problems(found):
            return found
    return None


def registered_base(
    base: str | Path,
    store: ArtifactStore,
    lineage: Mapping[str, str],
    protocol: RunProtocol | None,
    recipe: QuantizeConfig | None = None,
    need_twin: bool = True,
    progress: Progress | None = None,
) -> tuple[Manifest, Manifest | None, str]:
    """(quantized, twin, how it was found) for a registered version with ``lineage`` (its tags),
    whose run's sections are ``protocol``; ``recipe``: the caller's ``quantize.*`` settings, which
    must rebuild the same checkpoint (see the module docstring)."""
    qcfg = recipe or (protocol.quantize if protocol is not None else None)
    want = lineage.get("base_checkpoint")
    twin_dtype = qcfg.twin_dtype if qcfg is not None else None
    if not want:
        quantized, twin = base_artifacts(
            base, store, need_twin, None if is_checkpoint(base) else qcfg, progress
        )
        return (
            quantized,
            twin,
            "its run's recipe (registered before qerl recorded the checkpoint: unverified)",
        )
    # the caller's own recipe is built (or looked up by its key) and compared; else the recorded one
    found = find_checkpoint(store, want) if recipe is None else None
    quantized, how = found, "the checkpoint it trained on, from the store"
    if quantized is None and is_checkpoint(base):
        quantized, how = Manifest.load(Path(base)), f"the checkpoint it trained on, {base}"
    elif quantized is None:
        qcfg = qcfg or QuantizeConfig()
        data, held = None, frozenset[str]()
        if qcfg.method == "gptq" and qcfg.scheme == "nvfp4":
            if protocol is None or protocol.data is None or protocol.template is None:
                raise ArtifactError(
                    "its GPTQ base is not in this store, and its run logged no data and rollout sections "
                    "to rebuild the calibration from: pass its quantize export as --base"
                )
            data, held = quantize_inputs(protocol.data, protocol.template, protocol.eval.validation)
        quantized = quantize.run(qcfg, base, store, data, progress, held)
        how = "the checkpoint it trained on, rebuilt from its run's recipe, data and validation split"
    if quantized.digest != want:
        raise ArtifactError(
            f"the base checkpoint {quantized.digest[:16]} ({quantized.dir}) is not the one the version was "
            f"trained on ({want[:16]}): it would be evaluated on other weights. Pass the run's quantize "
            "export as --base, or evaluate on the machine that ran it"
        )
    return quantized, _twin(quantized, store, need_twin, twin_dtype), how


def eval_base(
    spec: str,
    store: ArtifactStore,
    need_twin: bool,
    recipe: QuantizeConfig | None,
    lineage: Mapping[str, str] | None,
    protocol: RunProtocol | None,
    progress: Progress | None = None,
) -> tuple[str, Manifest, Manifest | None, str]:
    """``qerl eval --base``'s base: (the model, its quantized checkpoint, the twin where the engine
    needs one, how the checkpoint was found). For a registered version (``lineage``: its tags) the
    exact checkpoint it trained on (``registered_base``); else a plain model quantized by ``recipe``,
    else by its run's recipe (``protocol``), else the default; an export as it is. A catalogue name
    is fetched first. No quality report: an evaluation needs none."""
    base = fetch_model.resolve_base(spec, store)  # a catalogue name becomes its directory
    if lineage is not None:
        quantized, twin, how = registered_base(base, store, lineage, protocol, recipe, need_twin, progress)
        return base, quantized, twin, how
    run_recipe = protocol.quantize if protocol is not None else None
    plain = recipe if recipe is not None or is_checkpoint(base) else run_recipe
    quantized, twin = base_artifacts(base, store, need_twin, plain, progress=progress)
    return base, quantized, twin, ""
