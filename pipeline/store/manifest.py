"""An artifact's self-description: ``Manifest`` (what made it, from what, every file's digest).

``manifest.json`` is written last into a finished artifact, so its presence marks completion. Each
file is recorded with its sha256, size and mtime: the size and mtime make the cheap check of a cache
hit, the sha256 the full one and the artifact's ``digest`` (what a downstream stage puts in its key).
Files that retention deleted on purpose stay recorded, listed in ``pruned`` with the reason, so the
digest, and every downstream key, is unchanged; a consumer asking for one gets an ``ArtifactError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from qerl.pipeline.store.files import sha256_file, sha256_json
from qerl.pipeline.store.layout import MANIFEST


class ArtifactError(RuntimeError):
    """An artifact is missing, corrupt or inconsistent; the message names the path."""


class FileRecord(BaseModel):
    sha256: str
    size: int
    mtime_ns: int


class Manifest(BaseModel):
    """A stage output's self-description: what made it, from what, and the digest of every file."""

    stage: str
    key: str
    config: dict[str, Any]
    inputs: dict[str, str] = Field(
        description="input name -> digest (an upstream manifest digest or a file sha256)"
    )
    code_version: str
    code_modules: list[str] = Field(
        default_factory=list, description="the module roots code_version hashed (empty: an older qerl)"
    )
    versions: dict[str, str] = Field(
        default_factory=dict, description="qerl, Python and the numerical dependencies that built it"
    )
    files: dict[str, FileRecord]
    created_at: str
    mode: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)
    pruned: dict[str, str] = Field(
        default_factory=dict,
        description="file name -> why it was deleted by retention (qerl gc); its record stays in files",
    )
    path: str = Field(default="", exclude=True)

    @property
    def dir(self) -> Path:
        return Path(self.path)

    def file(self, name: str) -> Path:
        if name not in self.files:
            raise ArtifactError(
                f"artifact {self.stage}/{self.key} has no file '{name}' (has: {sorted(self.files)})"
            )
        if name in self.pruned:
            raise ArtifactError(
                f"artifact {self.stage}/{self.key} no longer holds '{name}': {self.pruned[name]}"
            )
        return self.dir / name

    def require(self, *names: str) -> None:
        """Raise a clear ArtifactError unless every file of ``names`` (a file, or a folder: the files
        under it) is present in the manifest and not pruned; a consumer calls this before reading."""
        for name in names:
            under = [n for n in self.files if n.startswith(name.rstrip("/") + "/")]
            for have in under or [name]:
                self.file(have)

    @property
    def digest(self) -> str:
        """Content digest: what a downstream stage puts in its key for this input."""
        return sha256_json(
            {"stage": self.stage, "files": {k: v.sha256 for k, v in sorted(self.files.items())}}
        )

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise ArtifactError(f"no manifest at {path}")
        manifest = cls.model_validate_json(path.read_text())
        manifest.path = str(directory)
        return manifest


class BuildResult(BaseModel):
    """What a stage's build function returns besides the files it wrote."""

    mode: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)


def file_record(path: Path) -> FileRecord:
    stat = path.stat()
    return FileRecord(sha256=sha256_file(path), size=stat.st_size, mtime_ns=stat.st_mtime_ns)


def tree_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as a stage consumes it: its folder and the digest that names it in cache keys
    (a train step's or a fetched version's manifest digest; a registered champion is known by the
    digest of the train step that made it)."""

    dir: Path
    digest: str

    @classmethod
    def of(cls, manifest: Manifest, digest: str | None = None) -> Adapter:
        """The adapter in ``manifest``'s ``adapter/`` folder (a train or warm-start artifact)."""
        return cls(manifest.dir / "adapter", digest or manifest.digest)
