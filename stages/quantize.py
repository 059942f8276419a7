"""Stage ``quantize``: HF model -> NVFP4A16 checkpoint, plus export.

What: ``run`` turns a local Hugging Face model directory (or a hub id, resolved with
``huggingface_hub.snapshot_download`` only when SRC is not a local directory) into a compressed-tensors
NVFP4A16 checkpoint. The artifact directory *is* the loadable checkpoint: ``config.json`` with its
``quantization_config``, ``model-0000i-of-0000n.safetensors`` + index, tokenizer files and generation
config. Its dequantized twin, what vLLM serves on a CPU, is the next stage (``qerl.stages.dequantize``).
``export`` copies an artifact to a user path atomically.

``scheme: nf4`` (QLoRA's base, the ``qlora`` arm of an ablation) is ``qerl.stages.quantize_nf4``'s
and ``scheme: none`` (the unquantized base of the 16-bit arm) ``qerl.stages.quantize_none``'s: ``run``
dispatches to them, and each keys its own module's code, so an edit of one scheme re-quantizes no
other (a stage's code version leaves other stage modules out, ``qerl.pipeline.store.code_version``).

How: everything that can reject the model (architecture, MoE, unknown linears, shapes) runs on
config.json and the safetensors headers before the store is asked to build anything; the build then
streams one tensor group at a time through ``qerl.pipeline.nvfp4.safetensors_io.write_sharded`` (see there for the
memory bound). The cache key is the base model's content digest, the recipe and the code version of this
module's import closure (the checkpoint format, grouping, the methods and the kernels), so a second run
is a lookup.
The manifest's ``mode`` records which quantizer ran (``nvfp4/numba``, ``nvfp4/torch`` or
``nvfp4/triton``); all three are bit-identical to the reference.

``quantize.method`` (``qerl.pipeline.nvfp4.recipe``): ``rtn`` runs that dispatch and keys its cache
exactly as before the methods existed; ``mse`` runs the plain-PyTorch scale search per tensor group
on the CPU (mode ``nvfp4/torch``); ``gptq`` (on the GPU where there is one: mode ``nvfp4/torch-cuda``,
float32 sums that differ from the CPU's in the last bits, so the device is recorded, not keyed: either
is GPTQ's answer) tokenizes the calibration text first (its digest joins
the cache key, so a missing data file fails before any write; for ``samples`` the prompts' digest,
the base model's completions being generated in the build:
``qerl.pipeline.data.calibration_tokens``), then the producers pull each layer's tensors from the
sequential GPTQ generator (``qerl.pipeline.nvfp4.calibration.gptq_layers``) as ``write_sharded``
reaches them in name order, so one layer's work is alive at a time. The manifest
records ``method`` and, for gptq, the calibration source, sequence and token counts and digest.
``quantize.keep`` copies the linears it names (mixed precision; ``quantization_config`` ignores them)
and the manifest's ``keep`` records them with their bytes and what NVFP4 would have taken.

What quantization cost (``quantize.quality``) is the next stage's (``qerl.stages.quality``), keyed on
this artifact's digest: its settings are not in this key, and a report that fails keeps the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import qerl.kernels.nvfp4_dispatch as nvfp4_dispatch
import qerl.kernels.nvfp4_reference as nvfp4_reference
import torch
from qerl.pipeline.config import key_payload
from qerl.pipeline.data.calibration_tokens import calibration_tokens
from qerl.pipeline.data.datasets import DataConfig
from qerl.pipeline.nvfp4.calibration import gptq_layers, layer_index
from qerl.pipeline.nvfp4.grouping import Group, kept_linears, kept_memory, plan_quantization
from qerl.pipeline.nvfp4.marlin import marlin_zeroed_blocks
from qerl.pipeline.nvfp4.recipe import (
    QuantizeConfig,
    UnsupportedModelError,
    check_architecture,
    quantization_config,
    read_model_config,
    twin_dtype,
)
from qerl.pipeline.nvfp4.safetensors_io import (
    Progress,
    copy_aux_files,
    copy_producer,
    read_tensor,
    safetensors_index,
    tensor_bar,
    write_sharded,
)
from qerl.pipeline.nvfp4.scale_search import quantize_mse
from qerl.pipeline.runtime.device import default_device, free_device_cache
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.code_version import code_version
from qerl.pipeline.store.files import atomic_write_json
from qerl.pipeline.store.layout import QUANTIZE_STAGE
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest
from qerl.stages import quantize_nf4, quantize_none

__all__ = ["STAGE", "QuantizeConfig", "export", "resolve_source", "run", "run_with_status", "twin_dtype"]

log = logging.getLogger("qerl.stages.quantize")


STAGE = QUANTIZE_STAGE
EXPORT_MARKER = ".qerl-export.json"


def resolve_source(src: str | Path) -> Path:
    """A local model directory as is; otherwise a hub id fetched with snapshot_download (clear error offline)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise UnsupportedModelError(f"SRC {src} is a file; give a model directory or a hub id")
    text = str(src)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise UnsupportedModelError(
            f"SRC {src} is not a local directory and does not look like a hub id (org/name)"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
        )
    except Exception as err:  # noqa: BLE001 - any hub failure becomes one clear message
        offline = os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True")
        why = "HF_HUB_OFFLINE is set" if offline else "the hub is unreachable or the id is wrong"
        raise UnsupportedModelError(
            f"SRC '{src}' is not a local directory and could not be fetched from the Hugging Face hub "
            f"({why}): {type(err).__name__}: {err}"
        ) from err


def _device() -> torch.device:
    return torch.device(default_device())


def _quant_producer(
    group: Group, device: torch.device, cfg: QuantizeConfig
) -> Callable[[], dict[str, torch.Tensor]]:
    def produce() -> dict[str, torch.Tensor]:
        weights = {s.name: read_tensor(s).to(device) for s in group.sources}
        gs = None
        if len(weights) > 1:  # fused q/k/v or gate/up: one global scale from the max amax of the group
            amax = max(nvfp4_reference.tensor_amax(w, name) for name, w in weights.items())
            gs = nvfp4_reference.global_scale(amax)
        out: dict[str, torch.Tensor] = {}
        for name, w in weights.items():
            if cfg.method == "mse":
                packed, scale, g = quantize_mse(w, gs, name=name, sweep=cfg.scale_sweep)
            else:
                packed, scale, g = nvfp4_dispatch.quantize(w, gs, name=name)
            base = name[: -len(".weight")]
            out[f"{base}.weight_packed"] = packed.cpu()
            out[f"{base}.weight_scale"] = scale.cpu()
            out[f"{base}.weight_global_scale"] = g.cpu()
        return out

    return produce


def _gptq_producers(layers: Iterator[tuple[int, dict[str, torch.Tensor]]]) -> Callable[[Group], Callable]:
    """Producers that pull a group's tensors from the sequential GPTQ generator, layer by layer:
    ``write_sharded`` asks in name order, so layer i's results are complete before layer i+1 runs."""
    current: dict = {"index": -1, "tensors": {}}

    def for_group(group: Group) -> Callable[[], dict[str, torch.Tensor]]:
        def produce() -> dict[str, torch.Tensor]:
            i = layer_index(group.sources[0].name)
            if i < current["index"]:
                raise RuntimeError(f"GPTQ results of layer {i} asked for after layer {current['index']}")
            while current["index"] < i:
                current["index"], current["tensors"] = next(layers)
            return {s.name: current["tensors"].pop(s.name) for s in group.outputs}

        return produce

    return for_group


def run(
    cfg: QuantizeConfig,
    src: str | Path,
    store: ArtifactStore,
    data: DataConfig | None = None,
    progress: Progress | None = None,
    held_out: frozenset[str] = frozenset(),
) -> Manifest:
    """Quantize SRC to an NVFP4A16 checkpoint artifact (cached by base digest + recipe + code).

    ``data`` (the run's data config) is where ``method: gptq`` finds its calibration text, none of
    whose questions is in ``held_out`` (the run's validation questions); ``progress(done, total)``
    counts the tensors written (a build only: a cache hit calls nothing)."""
    return run_with_status(cfg, src, store, data, progress, held_out)[0]


def run_with_status(
    cfg: QuantizeConfig,
    src: str | Path,
    store: ArtifactStore,
    data: DataConfig | None = None,
    progress: Progress | None = None,
    held_out: frozenset[str] = frozenset(),
) -> tuple[Manifest, bool]:
    """``run`` that also says whether the artifact came from the cache."""
    src_dir = resolve_source(src)
    if cfg.scheme == "none":  # each scheme's own stage module: its code alone is its key's
        return quantize_none.run_none(cfg, src_dir, str(src), store, progress)
    if cfg.scheme == "nf4":
        return quantize_nf4.run_nf4(cfg, src_dir, str(src), store, progress)
    model_config = read_model_config(src_dir)
    arch = check_architecture(model_config, cfg)
    specs = safetensors_index(src_dir)
    plan = plan_quantization(specs, cfg)  # every rejection happens here, before any write
    kept = kept_linears(specs, cfg)
    base_digest = store.source_digest(src_dir)
    code = code_version(sys.modules[__name__])  # the import closure: format, grouping, methods, kernels
    # gptq: the token ids come as a function (source samples generates them in the build, not on a cache hit)
    calib_ids, calib = (
        calibration_tokens(cfg.calibration, src_dir, data, held_out) if cfg.method == "gptq" else (None, None)
    )
    device, backend = _device_and_backend(cfg)

    def build(tmp: Path) -> BuildResult:
        t0 = time.perf_counter()
        aux = copy_aux_files(src_dir, tmp)
        config = dict(model_config)
        config["quantization_config"] = quantization_config(cfg, kept)
        atomic_write_json(tmp / "config.json", config)
        if cfg.method == "gptq":
            quant = _gptq_producers(gptq_layers(src_dir, specs, plan, cfg, calib_ids(), device))
        else:
            quant = lambda g: _quant_producer(g, device, cfg)  # noqa: E731
        groups = [(g.outputs, quant(g) if g.quantize else copy_producer(g.sources[0])) for g in plan]
        sizes = iter([len(g.sources) for g in plan])
        with tensor_bar(sum(len(g.sources) for g in plan), f"quantize {src_dir.name}", progress) as advance:
            write_sharded(tmp, groups, int(cfg.max_shard_mb * 2**20), progress=lambda _: advance(next(sizes)))
        seconds = time.perf_counter() - t0
        n_quant = sum(len(g.sources) for g in plan if g.quantize)
        bytes_in = sum(s.nbytes for s in specs.values())
        bytes_out = sum(s.nbytes for g in plan for s in g.outputs)
        log.info(
            "quantized %d linears of %s (method %s) with the %s backend in %.1fs",
            *(n_quant, src_dir, cfg.method, backend, seconds),
        )
        marlin = marlin_zeroed_blocks(tmp, [[o.name for o in g.outputs] for g in plan if g.quantize])
        free_device_cache()  # GPTQ's Hessians and layer copies: the next stage gets the device whole
        return BuildResult(
            mode=f"nvfp4/{backend}",
            metrics={"seconds": seconds, "bytes_in": bytes_in, "bytes_out": bytes_out},
            extra={
                "base_digest": base_digest,
                "source": str(src),
                "architecture": arch,
                "recipe": quantization_config(cfg, kept),
                "quantized_tensors": n_quant,
                "copied_tensors": sum(1 for g in plan if not g.quantize),
                "fused_groups": sum(1 for g in plan if g.quantize and len(g.sources) > 1),
                "aux_files": aux,
                "max_shard_mb": cfg.max_shard_mb,  # a resource field: recorded, not keyed
                "backend": backend,
                "method": cfg.method,
                "marlin": marlin,
                **({"keep": kept_memory(specs, kept)} if kept else {}),
                **({"calibration": calib} if calib else {}),
            },
        )

    return store.produce(STAGE, _recipe_key(cfg, calib), {"base": base_digest}, code, build)


def _device_and_backend(cfg: QuantizeConfig) -> tuple[torch.device, str]:
    """Where the quantizer runs and the backend the manifest names: RTN dispatches to the kernels of
    the device; GPTQ is plain torch, on the GPU where there is one (its last bits differ from the
    CPU's); MSE is plain torch on the CPU."""
    device = _device() if cfg.method in ("rtn", "gptq") else torch.device("cpu")
    if cfg.method == "rtn":
        return device, nvfp4_dispatch.quantize_backend(device)
    return device, "torch" if device.type == "cpu" else f"torch-{device.type}"


def _recipe_key(cfg: QuantizeConfig, calibration: dict | None = None) -> dict:
    """The quantize stage's config key: the recipe without the twin's dtype (a dequantize setting).

    ``scheme`` is left out for nvfp4 (the recipe it always was); ``_run_unquantized`` has its own key.
    Resource fields (the shard size) are left out too (``key_payload``); the manifest's extra records it.
    ``method: rtn`` keys exactly as before the method existed (its caches stay valid); ``mse`` adds the
    method and its sweep; ``gptq`` also the calibration settings and the calibration text's digest."""
    key = {k: v for k, v in key_payload(cfg).items() if k not in ("twin_dtype", "scheme")}
    key.pop("quality", None)  # the quality stage's (qerl.stages.quality), not this checkpoint's
    if not key["keep"]:
        del key["keep"]  # no mixed precision: the key it always had
    calib_settings = key.pop("calibration")
    sweep = key.pop("scale_sweep")
    if key.pop("method") == "rtn":
        return key
    key.update(method=cfg.method, scale_sweep=sweep)
    if cfg.method == "gptq":
        if calibration is None:
            raise ValueError("quantize.method gptq: the cache key needs the calibration digest")
        key["calibration"] = {**calib_settings, "digest": calibration["digest"]}
    return key


def export(manifest: Manifest, dst: str | Path) -> Path:
    """Copy an artifact to ``dst`` atomically (temp dir beside it, then rename).

    A non-empty ``dst`` is replaced only if it is a previous qerl export (it holds the marker file).
    """
    dst = Path(dst).expanduser().resolve()
    if dst.exists() and (not dst.is_dir() or (any(dst.iterdir()) and not (dst / EXPORT_MARKER).is_file())):
        raise ArtifactError(
            f"refusing to overwrite {dst}: it exists, is not empty and is not a previous qerl export"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(manifest.dir, tmp)
        marker = {
            "stage": manifest.stage,
            "key": manifest.key,
            "digest": manifest.digest,
            "mode": manifest.mode,
        }
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if dst.exists():
            os.replace(dst, old)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return dst
