"""Code versions: the hash of a stage's source files that goes into its cache keys.

A stage passes its own module and the modules whose code defines its output, so editing one of them
invalidates exactly the caches of the stages that list it; downstream stages follow through their
input digests. The installed package version is hashed too, so a release invalidates everything.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
from pathlib import Path
from types import ModuleType

from qerl.pipeline.store.manifest import ArtifactError


def package_version() -> str:
    try:
        return importlib.metadata.version("qerl")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def code_version(*modules: ModuleType | str | Path) -> str:
    """Hash of the given modules' source files plus the package version.

    A stage passes its own module (and the kernels whose numerics define its output), so editing a
    stage invalidates exactly that stage's caches; downstream stages follow through input digests.
    """
    digest = hashlib.sha256(package_version().encode())
    for module in modules:
        if isinstance(module, ModuleType):
            source_file = inspect.getsourcefile(module)
            if source_file is None:
                raise ArtifactError(f"module {module.__name__} has no source file to hash")
            path = Path(source_file)
        else:
            path = Path(module)
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
