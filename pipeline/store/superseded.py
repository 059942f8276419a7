"""Superseded copies of the base model's artifacts, which ``qerl gc`` removes.

Every cache key holds its stage's code version (``qerl.pipeline.store.code_version``). After an
upgrade that changes the code of a base stage's import closure (the kernels, the checkpoint
format), the next run builds the fetched model, the quantized checkpoint and the dequantized twin
again under new keys. Where the change did not touch the numbers, the new artifacts hold the old
ones' bytes. A quantized checkpoint of a 7B model is gigabytes, and the run-based retention
(``qerl.pipeline.store.retention``) never frees it, since no run record drops it.

An artifact is *superseded* when all of these hold:

- its stage is one of ``BASE_STAGES``;
- its code version is not the installed qerl's for that stage, so no lookup by this qerl reaches it;
- an artifact of the same stage that the installed qerl built holds the same content (same digest)
  and is whole (nothing pruned), so nothing is lost by removing the copy.

It is removed whole, manifest included. This departs from the prunes, which keep every manifest so
that a lookup still finds the artifact. Here no lookup by this qerl can. An older qerl that looks
the old key up again builds it again, where a kept manifest would serve it without its files.
Downstream keys hold input *digests*, not paths, so every cached rollout, step and evaluation built
on the old copy stays valid on the new one. Paths in run records (``quantize.manifest``) are
records, read by nothing.

A copy whose content no current artifact holds is kept: a code change that moved the numbers
leaves the old base as the only record of what earlier runs trained on. While any run is live,
nothing is removed, because it may be an older qerl's run, reading the old copy by path.

``qerl.pipeline.store.retention`` plans and applies the removal: renamed into trash, then deleted,
under the key's lock, ``removed`` in ``gc.jsonl``. The caller names the installed code versions
(``current``: stage -> its versions, one per scheme: an NF4 base's quantize stage has other code
than an NVFP4 one's). The store layer does not import the stages (data flows one way),
so ``qerl gc`` computes them (``qerl.flows.tool_commands``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.layout import MANIFEST, OBJECTS_DIR
from qerl.pipeline.store.manifest import ArtifactError, Manifest

BASE_STAGES = ("demo-base", "fetch-model", "quantize", "dequantize")


def _manifests(store: ArtifactStore, stage: str, notes: list[str]) -> list[Manifest]:
    root = store.root / OBJECTS_DIR / stage
    out = []
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if not (directory / MANIFEST).is_file():
            continue
        try:
            out.append(Manifest.load(directory))
        except (ValueError, ArtifactError) as err:  # the next lookup moves it aside; not gc's to judge
            notes.append(f"kept {directory}: unreadable manifest ({err})")
    return out


def superseded(
    store: ArtifactStore, current: Mapping[str, Collection[str]], notes: list[str]
) -> list[tuple[Manifest, str]]:
    """Each superseded artifact (module docstring) with why: the current artifact that holds its
    bytes. ``current``: stage -> the installed qerl's code versions for it (one per scheme)."""
    out = []
    for stage in BASE_STAGES:
        if stage not in current:
            continue
        manifests = _manifests(store, stage, notes)
        holders = {m.digest: m for m in manifests if m.code_version in current[stage] and not m.pruned}
        for m in manifests:
            holder = holders.get(m.digest)
            if m.code_version not in current[stage] and holder is not None:
                why = f"superseded: built by an older qerl (code {m.code_version}); {holder.key} holds the same bytes"
                out.append((m, why))
    return out
