"""Content-addressed artifact store: every stage output lives under a key and is written atomically.

The folders and files under the store root (objects/, tmp/, locks/, trash/, the audit logs) are
named, and drawn as a tree, in ``qerl.pipeline.store.layout``; the manifest is
``qerl.pipeline.store.manifest``.

The key is sha256 over (stage, canonical config JSON, input digests, code version). A stage's output
directory is built in tmp/, its files are hashed (streaming sha256), the manifest is written last and
the whole directory is renamed into place, so a reader sees either nothing or a complete artifact.
Two processes producing the same key serialise on a lock file; the second finds the first's result.

Integrity: a lookup checks every file's size and mtime against the manifest (a stat per file, so a
cache hit costs the same for a tiny model and a 7B checkpoint) and ``verify="full"`` re-hashes the
contents. A manifest whose files are missing or changed is reported, moved aside, and the stage
recomputes. Departure from a pure content hash: size+mtime is the default check because re-hashing
a multi-GB checkpoint on every cache hit costs far more than the lookup it guards;
``QERL_VERIFY=full`` makes every lookup re-hash.

Retention (``qerl.pipeline.store.retention``, ``qerl gc``) deletes files on purpose with ``prune``: the
manifest keeps their records (the digest, and every downstream key, is unchanged) and names them in
``pruned``; lookups skip them and a consumer asking for one gets an ArtifactError saying why.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from qerl.pipeline.config import config_hash
from qerl.pipeline.store.faults import fault_point
from qerl.pipeline.store.files import (
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    sha256_file,
    sha256_json,
)
from qerl.pipeline.store.layout import (
    BUILDS_LOG,
    DIGESTS_MEMO,
    GC_LOG,
    LOCKS_DIR,
    MANIFEST,
    OBJECTS_DIR,
    TMP_DIR,
    TRASH_DIR,
)
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest, file_record, tree_files

log = logging.getLogger("qerl.artifacts")


class ArtifactStore:
    """A directory of content-addressed stage outputs (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        for sub in (OBJECTS_DIR, TMP_DIR, LOCKS_DIR, TRASH_DIR):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # keys -------------------------------------------------------------------------------------
    @staticmethod
    def key(stage: str, config: BaseModel | dict[str, Any], inputs: dict[str, str], code: str) -> str:
        return sha256_json(
            {
                "stage": stage,
                "config": config_hash(config),
                "inputs": dict(sorted(inputs.items())),
                "code": code,
            }
        )[:32]

    def path_for(self, stage: str, key: str) -> Path:
        return self.root / OBJECTS_DIR / stage / key

    # lookup -----------------------------------------------------------------------------------
    def problems(self, manifest: Manifest, full: bool = False) -> list[str]:
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
            elif (full or stat.st_mtime_ns != rec.mtime_ns) and sha256_file(path) != rec.sha256:
                bad.append(f"{name}: sha256 mismatch")
        return bad

    def get(self, stage: str, key: str, verify: str | None = None, _locked: bool = False) -> Manifest | None:
        """The finished artifact for (stage, key), or None; a corrupt one is moved aside.

        A problem is confirmed under the key's lock before anything is discarded: retention
        (``prune``) rewrites the manifest and then removes files under that lock, so a reader that
        loaded the old manifest just before a prune must not mistake the pruned file for corruption.
        """
        directory = self.path_for(stage, key)
        if not (directory / MANIFEST).is_file():
            return None
        full = (verify or os.environ.get("QERL_VERIFY", "fast")) == "full"
        manifest, bad = self._check(directory, full)
        if not bad:
            return manifest
        with contextlib.nullcontext() if _locked else self.lock(f"{stage}-{key}"):
            if not (directory / MANIFEST).is_file():
                return None
            manifest, bad = self._check(directory, full)
            if bad:
                log.warning("artifact %s/%s is corrupt (%s): recomputing", stage, key, "; ".join(bad))
                self._discard(directory)
                return None
        return manifest

    def _check(self, directory: Path, full: bool) -> tuple[Manifest | None, list[str]]:
        try:
            manifest = Manifest.load(directory)
        except (ValueError, ArtifactError) as err:
            return None, [f"unreadable manifest ({err})"]
        return manifest, self.problems(manifest, full=full)

    def prune(self, stage: str, key: str, names: list[str], reason: str) -> int:
        """Delete files of a finished artifact on purpose (retention); returns the bytes freed.

        The manifest keeps every file's record (so the artifact's digest, and with it every
        downstream key, is unchanged) and lists the deleted ones in ``pruned`` with ``reason``; a
        lookup still serves the artifact and a consumer of a pruned file gets an ArtifactError that
        says why (``Manifest.file``/``require``). Order, for crash safety: the manifest is rewritten
        first (atomically), then the files are renamed aside into trash/ and deleted. A crash in
        between leaves a file marked pruned but still present (harmless; the next prune of the
        artifact or ``qerl gc``'s trash sweep removes it), never a manifest that names a missing
        file, which a lookup would take for corruption and discard whole.
        """
        with self.lock(f"{stage}-{key}"):
            directory = self.path_for(stage, key)
            manifest = Manifest.load(directory)
            unknown = [n for n in names if n not in manifest.files]
            if unknown:
                raise ArtifactError(f"cannot prune {unknown} from {stage}/{key}: not in its manifest")
            when = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
            fresh = {n: f"pruned {when}: {reason}" for n in names if n not in manifest.pruned}
            manifest.pruned.update(fresh)
            atomic_write_text(directory / MANIFEST, manifest.model_dump_json(indent=2))
            aside = self.root / TRASH_DIR / f"pruned-{stage}-{key}-{uuid.uuid4().hex[:8]}"
            freed = 0
            for name in manifest.pruned:
                path = directory / name
                if path.is_file():
                    freed += path.stat().st_size
                    (aside / name).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(path, aside / name)
            for parent in sorted({(directory / n).parent for n in manifest.pruned}, reverse=True):
                with contextlib.suppress(OSError):  # a folder emptied by the prune (adapter/)
                    if parent != directory:
                        parent.rmdir()
            shutil.rmtree(aside, ignore_errors=True)
        if fresh:
            self._journal({"stage": stage, "key": key, "event": "pruned", "files": sorted(fresh)}, GC_LOG)
        return freed

    def _discard(self, directory: Path) -> None:
        if directory.exists():
            os.replace(directory, self.root / TRASH_DIR / f"{directory.name}-{uuid.uuid4().hex[:8]}")

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        path = self.root / LOCKS_DIR / f"{name}.lock"
        with open(path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def try_lock(self, name: str) -> Iterator[bool]:
        """Non-blocking ``lock``: yields whether it was taken (held elsewhere: a build is running)."""
        with open(self.root / LOCKS_DIR / f"{name}.lock", "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # produce ----------------------------------------------------------------------------------
    def produce(
        self,
        stage: str,
        config: BaseModel | dict[str, Any],
        inputs: dict[str, str],
        code: str,
        build: Callable[[Path], BuildResult | None],
        heal: bool = False,
    ) -> tuple[Manifest, bool]:
        """Return (manifest, cached). ``build(tmpdir)`` writes the outputs; it runs only on a miss,
        or, with ``heal``, on a hit that retention pruned: then the pruned files are rebuilt and put
        back (``_heal``), and the result counts as not cached."""
        key = self.key(stage, config, inputs, code)
        if (hit := self.get(stage, key)) is not None:
            if heal and hit.pruned:
                return self._heal(hit, build), False
            return hit, True
        with self.lock(f"{stage}-{key}"):
            if (hit := self.get(stage, key, _locked=True)) is not None:
                return hit, True
            tmp = self.root / TMP_DIR / f"{stage}-{key}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            try:
                result = build(tmp) or BuildResult()
                files = {str(p.relative_to(tmp)): file_record(p) for p in tree_files(tmp)}
                config_dump = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
                manifest = Manifest(
                    stage=stage,
                    key=key,
                    config=config_dump,
                    inputs=inputs,
                    code_version=code,
                    files=files,
                    created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                    mode=result.mode,
                    metrics=result.metrics,
                    extra=result.extra,
                )
                fault_point(stage)
                atomic_write_text(tmp / MANIFEST, manifest.model_dump_json(indent=2))
                final = self.path_for(stage, key)
                final.parent.mkdir(parents=True, exist_ok=True)
                self._discard(final)  # a manifest-less leftover cannot exist, but a corrupt one can
                os.replace(tmp, final)
                fsync_dir(final.parent)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            manifest.path = str(final)
            self._journal({"stage": stage, "key": key, "event": "built", "pid": os.getpid()})
            log.info("stage %s wrote %s (%d files)", stage, final, len(files))
            return manifest, False

    def _heal(self, hit: Manifest, build: Callable[[Path], BuildResult | None]) -> Manifest:
        """Rebuild an artifact whose files retention pruned and put the pruned files back.

        Two runs can share a prefix of artifacts (same config and inputs up to a step: the AQN arm of
        an ablation equals the no-AQN arm while sigma is 0); retention of the run that made them may
        prune a checkpoint the other run must continue from. The build is deterministic, so a rebuild
        gives the same bytes: each pruned file is checked against the sha256 its manifest kept and
        only then moved in, and ``pruned`` forgets it. A file that differs is an error naming it
        (then the chain cannot continue from this artifact; nothing is changed).
        """
        with self.lock(f"{hit.stage}-{hit.key}"):
            directory = self.path_for(hit.stage, hit.key)
            manifest = Manifest.load(directory)
            if not manifest.pruned:  # healed meanwhile by another process
                manifest.path = str(directory)
                return manifest
            tmp = self.root / TMP_DIR / f"heal-{hit.stage}-{hit.key}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            try:
                build(tmp)
                for name in manifest.pruned:
                    got = sha256_file(tmp / name) if (tmp / name).is_file() else "missing"
                    if got != manifest.files[name].sha256:
                        raise ArtifactError(
                            f"cannot restore {hit.stage}/{hit.key} file '{name}': the rebuild gave "
                            f"sha256 {got[:12]}, the manifest records {manifest.files[name].sha256[:12]} "
                            "(not reproducible here); start the run again from a step that is intact"
                        )
                for name in manifest.pruned:
                    (directory / name).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp / name, directory / name)
                    manifest.files[name] = file_record(directory / name)  # same sha256; the new mtime
                healed = sorted(manifest.pruned)
                manifest.pruned = {}
                atomic_write_text(directory / MANIFEST, manifest.model_dump_json(indent=2))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        manifest.path = str(directory)
        self._journal({"stage": hit.stage, "key": hit.key, "event": "healed", "files": healed}, GC_LOG)
        log.info("stage %s: rebuilt the pruned %s of %s", hit.stage, healed, directory)
        return manifest

    def _journal(self, entry: dict[str, Any], name: str = BUILDS_LOG) -> None:
        """Append to builds.jsonl: the audit trail that proves no finished stage ran twice (deletions
        by retention go to gc.jsonl, so that trail stays one line per build)."""
        entry = {"at": _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"), **entry}
        with self.lock("journal"), open(self.root / name, "a") as fh:
            fh.write(json.dumps(entry) + "\n")

    def builds(self) -> list[dict[str, Any]]:
        path = self.root / BUILDS_LOG
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    # source digests ---------------------------------------------------------------------------
    def source_digest(self, path: str | Path) -> str:
        """Content digest of a file or directory outside the store, memoised by (size, mtime)."""
        path = Path(path).resolve()
        if not path.exists():
            raise ArtifactError(f"source not found: {path}")
        files = [path] if path.is_file() else tree_files(path)
        fingerprint = sha256_json([(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files])
        memo_path = self.root / DIGESTS_MEMO
        with self.lock("digests"):
            memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
            if memo.get(str(path), {}).get("fingerprint") == fingerprint:
                return memo[str(path)]["digest"]
            base = path if path.is_dir() else path.parent
            digest = sha256_json({str(p.relative_to(base)): sha256_file(p) for p in files})
            memo[str(path)] = {"fingerprint": fingerprint, "digest": digest}
            atomic_write_json(memo_path, memo)
        return digest
