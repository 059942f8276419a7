"""How a cache hit is checked against its manifest before it is served: ``QERL_VERIFY``.

Three modes, chosen per lookup (``verify=``) or for the process (``QERL_VERIFY``):

- ``once`` (the default): the first lookup of a file by a store object hashes it (sha256 against the
  manifest); later lookups by the same object compare size, mtime and inode with what was hashed.
  A run holds one store object, so every artifact a night touches (the base it serves, each cached
  step it walks through, the adapter it continues from, evaluates and registers) is content-checked
  once, when the night first asks for it. A byte changed on disk since it was written, even with size
  and mtime kept, is found then: the artifact is moved aside and the stage rebuilds it;
- ``full``: every lookup hashes every file;
- ``fast``: size and mtime only (a stat per file), the cheapest and blind to a same-size, same-mtime
  change; for a store known to be sound and too large to read once a night.

Cost of ``once``, measured on a loaded 2-core machine (``sha256_file`` at 0.75 GB/s): the demo's
store after a full run (188 artifacts, 52 MB on disk) is looked up whole in 0.22 s against 0.16 s
stat-only. A 7B night reads its fetched checkpoint (15 GB bf16) and NVFP4 base (about 5.5 GB), plus on a
resume the adapters it walks through (323 MB each at r=32) and the last optimizer state (about 650 MB):
about 21 GB, some 30 s at that rate (15 s at a free core's 1.4 GB/s): less than vLLM's start-up,
and small next to the hours of a 7B night. Hashing only the inputs of the builds that run would skip the fetched
checkpoint once the base is quantized, but would let a corrupt cached output through whenever nothing
rebuilds after it; hashing once what the night uses is the simpler guarantee and cheap enough.
"""

from __future__ import annotations

import os

from qerl.pipeline.store.files import sha256_file
from qerl.pipeline.store.manifest import Manifest

MODES = ("once", "full", "fast")
ENV = "QERL_VERIFY"


def verify_mode(verify: str | None = None) -> str:
    """The mode of a lookup: ``verify`` if given, else ``$QERL_VERIFY``, else ``once``."""
    mode = verify or os.environ.get(ENV) or MODES[0]
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not a verification mode: use one of {', '.join(MODES)}")
    return mode


class FileChecks:
    """Checks a manifest's files in a mode (module docstring), remembering the files it has hashed."""

    def __init__(self) -> None:
        self._hashed: dict[str, tuple[int, int, int]] = {}  # path -> (size, mtime_ns, inode) when hashed

    def problems(self, manifest: Manifest, mode: str) -> list[str]:
        """Files of ``manifest`` that are missing or no longer match their recorded digest."""
        bad = []
        for name, rec in manifest.files.items():
            if name in manifest.pruned:  # deleted on purpose by retention: not a corruption
                continue
            path = manifest.dir / name
            if not path.is_file():
                bad.append(f"{name}: missing")
                continue
            stat = path.stat()
            if stat.st_size != rec.size:
                bad.append(f"{name}: size {stat.st_size} != {rec.size}")
                continue
            seen = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
            unsure = stat.st_mtime_ns != rec.mtime_ns or mode == "full"
            if unsure or (mode == "once" and self._hashed.get(str(path)) != seen):
                if sha256_file(path) != rec.sha256:
                    bad.append(f"{name}: sha256 mismatch")
                    continue
                self._hashed[str(path)] = seen
        return bad
