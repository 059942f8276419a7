"""Content-addressed artifact store: every stage output lives under a key and is written atomically.

The folders and files under the store root (objects/, tmp/, locks/, trash/, the audit logs) are
named, and drawn as a tree, in ``qerl.pipeline.store.layout``; the manifest is
``qerl.pipeline.store.manifest``.

The key is sha256 over (stage, canonical config JSON, input digests, code version); the config part
leaves out resource fields (``qerl.pipeline.config.key_payload``), which the manifest records. A
stage's output directory is built in tmp/, its files are hashed (streaming sha256), the manifest is
written last and the whole directory is renamed into place, so a reader sees either nothing or a
complete artifact.
Two processes producing the same key serialise on a lock file; the second finds the first's result.

Integrity: a lookup checks every file against the manifest in the mode of
``qerl.pipeline.store.integrity`` (``QERL_VERIFY``): by default a store object hashes each file the
first time it is looked up and compares its stat afterwards, so a run content-checks once what it
uses; ``full`` re-hashes on every lookup, ``fast`` compares size and mtime only. A manifest whose
files are missing or changed is reported, moved aside, and the stage recomputes.

Retention (``qerl.pipeline.store.retention``, ``qerl gc``) deletes files on purpose with ``prune``: the
manifest keeps their records (the digest, and every downstream key, is unchanged) and names them in
``pruned``; lookups skip them and a consumer asking for one gets an ArtifactError saying why.

Fleet: a store opened with a shared store (``open_store`` with the run config's ``store.uri``;
``qerl.pipeline.store.shared``) is that machine's cache of it. A local miss is fetched from the shared
store (each file hashed while written) and served as a hit; a fetch whose bytes do not match their
manifest is logged and taken for a miss, so the stage rebuilds. ``produce`` builds under the local
lock and the fleet's build lock on the key (``qerl.pipeline.fleet.coordination.build_lock``: a no-op
without the fleet database), looks in the shared store once more, builds, commits locally and
publishes; when another machine published other bytes for the key first, its artifact replaces the
local one, so every machine uses one artifact per key. A local hit that the shared store lacks (built
before ``store.uri`` was set, or a publish cut off by a crash) is published by the next ``produce``
that finds it. ``prune``, ``_heal`` and ``_rekey`` work on the local cache only, and nothing retires
what the shared store holds (a limit: no retention of the shared store).
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
from qerl.pipeline.config import config_hash, config_record
from qerl.pipeline.store.code_version import dependency_versions, modules_of
from qerl.pipeline.store.faults import fault_point
from qerl.pipeline.store.files import (
    atomic_write_json,
    atomic_write_text,
    disk_full,
    fsync_dir,
    human_bytes,
    is_disk_full,
    read_json,
    sha256_file,
    sha256_json,
)
from qerl.pipeline.store.integrity import FileChecks, verify_mode
from qerl.pipeline.store.layout import (
    BUILDS_LOG,
    DIGESTS_MEMO,
    GC_LOG,
    LOCKS_DIR,
    MANIFEST,
    OBJECTS_DIR,
    STORE_DIR,
    TMP_DIR,
    TRASH_DIR,
)
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest, file_record, tree_files
from qerl.pipeline.store.shared import (
    BlobMismatchError,
    SharedStore,
    fetch,
    manifest_path,
    open_shared,
    publish,
)

log = logging.getLogger("qerl.artifacts")

REKEYED_TO = "rekeyed_to"  # a pruned artifact's manifest extra: the key its non-identical rebuild got


class ArtifactStore:
    """A directory of content-addressed stage outputs (see the module docstring)."""

    def __init__(self, root: str | Path, shared: SharedStore | None = None):
        self.root = Path(root).resolve()
        self.shared = shared  # None: this machine only; else this store is its cache (module docstring)
        for sub in (OBJECTS_DIR, TMP_DIR, LOCKS_DIR, TRASH_DIR):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._checks = FileChecks()  # the files this store object has hashed (integrity's "once")
        self._corrupt_blobs: set[str] = set()  # sha256 of shared blobs a fetch found corrupt

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
    def problems(self, manifest: Manifest, full: bool = False, verify: str | None = None) -> list[str]:
        """Files of ``manifest`` that are missing or no longer match their recorded digest, checked
        in the mode ``verify`` (``full``: re-hash all; default: ``QERL_VERIFY``, else ``once``)."""
        return self._checks.problems(manifest, "full" if full else verify_mode(verify))

    def get(self, stage: str, key: str, verify: str | None = None, _locked: bool = False) -> Manifest | None:
        """The finished artifact for (stage, key), or None; a corrupt one is moved aside.

        A problem is confirmed under the key's lock before anything is discarded: retention
        (``prune``) rewrites the manifest and then removes files under that lock, so a reader that
        loaded the old manifest just before a prune must not mistake the pruned file for corruption.
        With a shared store, a local miss is fetched from it under the key's lock (a fetch that fails
        verification is logged and is a miss; the shared store's manifest stays).
        """
        hit = self._get_local(stage, key, verify, _locked)
        if hit is not None or self.shared is None:
            return hit
        with contextlib.nullcontext() if _locked else self.lock(f"{stage}-{key}"):
            if not _locked and (hit := self._get_local(stage, key, verify, True)) is not None:
                return hit  # another process of this machine fetched it meanwhile
            return self._fetch(stage, key)

    def _fetch(self, stage: str, key: str) -> Manifest | None:
        """(stage, key) fetched from the shared store (caller holds the key's lock); None if it has
        none or what it has fails verification."""
        assert self.shared is not None
        try:
            return fetch(self.shared, stage, key, self)
        except BlobMismatchError as err:
            self._corrupt_blobs.add(err.expected)
            log.warning("%s: %s/%s is a miss, the stage rebuilds", err, stage, key)
        except ArtifactError as err:
            log.warning("cannot fetch %s/%s (%s): the stage rebuilds", stage, key, err)
        return None

    def _get_local(self, stage: str, key: str, verify: str | None, _locked: bool) -> Manifest | None:
        directory = self.path_for(stage, key)
        if not (directory / MANIFEST).is_file():
            return None
        mode = verify_mode(verify)
        manifest, bad = self._check(directory, mode)
        if not bad:
            return manifest
        with contextlib.nullcontext() if _locked else self.lock(f"{stage}-{key}"):
            if not (directory / MANIFEST).is_file():
                return None
            manifest, bad = self._check(directory, mode)
            if bad:
                log.warning("artifact %s/%s is corrupt (%s): recomputing", stage, key, "; ".join(bad))
                self._discard(directory)
                return None
        return manifest

    def _check(self, directory: Path, mode: str) -> tuple[Manifest | None, list[str]]:
        try:
            manifest = Manifest.load(directory)
        except (ValueError, ArtifactError) as err:
            return None, [f"unreadable manifest ({err})"]
        return manifest, self.problems(manifest, verify=mode)

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

    def _discard(self, directory: Path) -> Path | None:
        """Move ``directory`` aside into trash/; returns where it went (None: it did not exist)."""
        if not directory.exists():
            return None
        aside = self.root / TRASH_DIR / f"{directory.name}-{uuid.uuid4().hex[:8]}"
        os.replace(directory, aside)
        return aside

    def install(self, tmp: Path, stage: str, key: str) -> Path:
        """Rename the complete artifact folder ``tmp`` (its manifest written last) into objects/ as
        (stage, key), replacing what is there (moved into trash/); caller holds the key's lock."""
        final = self.path_for(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        self._discard(final)  # a manifest-less leftover cannot exist, but a corrupt one can
        os.replace(tmp, final)
        fsync_dir(final.parent)
        return final

    def _build_lock(self, stage: str, key: str) -> contextlib.AbstractContextManager[Any]:
        """The fleet's build lock on a key (every machine sees it; a no-op without the fleet
        database); none for a store of this machine only."""
        if self.shared is None:
            return contextlib.nullcontext()
        from qerl.pipeline.fleet.coordination import build_lock  # psycopg: imported on a fleet only

        return build_lock(f"{stage}-{key}")

    def _share(self, manifest: Manifest) -> Manifest:
        """Publish ``manifest`` (a local artifact; caller holds its lock); when the shared store holds
        another machine's bytes for the key, fetch those over the local copy and return them."""
        assert self.shared is not None
        redo = self._corrupt_blobs & {r.sha256 for r in manifest.files.values()}
        there = publish(self.shared, manifest, manifest.dir, overwrite=redo)
        self._corrupt_blobs -= redo
        if there.digest == manifest.digest:
            return manifest
        log.warning(
            "stage %s: %s holds other bytes for %s/%s (another machine built it first): using those",
            manifest.stage,
            self.shared.describe(),
            manifest.stage,
            manifest.key,
        )
        return self._fetch(manifest.stage, manifest.key) or manifest

    def _served(self, hit: Manifest, locked: bool = False) -> Manifest:
        """A hit, published first when the shared store lacks it (see the module docstring)."""
        if self.shared is None or self.shared.has(manifest_path(hit.stage, hit.key)):
            return hit
        with contextlib.nullcontext() if locked else self.lock(f"{hit.stage}-{hit.key}"):
            return self._share(hit)

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
        if (hit := self._get_local(stage, key, None, False)) is not None:
            if heal and hit.pruned:
                return self._heal(hit, build), False
            return self._served(hit), True
        with self.lock(f"{stage}-{key}"), self._build_lock(stage, key):
            if (hit := self.get(stage, key, _locked=True)) is not None:  # local, else fetched
                return self._served(hit, locked=True), True
            tmp = self.root / TMP_DIR / f"{stage}-{key}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            try:
                result = build(tmp) or BuildResult()
                files = {str(p.relative_to(tmp)): file_record(p) for p in tree_files(tmp)}
                config_dump = config_record(config)  # the whole config: resources too
                manifest = Manifest(
                    stage=stage,
                    key=key,
                    config=config_dump,
                    inputs=inputs,
                    code_version=code,
                    code_modules=list(modules_of(code)),
                    versions=dependency_versions(),
                    files=files,
                    created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                    mode=result.mode,
                    metrics=result.metrics,
                    extra=result.extra,
                )
                fault_point(stage)
                atomic_write_text(tmp / MANIFEST, manifest.model_dump_json(indent=2))
                final = self.install(tmp, stage, key)
            except Exception as err:
                if not is_disk_full(err):
                    raise
                written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
                needed = f"more than {human_bytes(written)}" if written else "more than the disk had left"
                raise disk_full(tmp, f"the {stage} artifact", needed) from err
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            manifest.path = str(final)
            self._journal({"stage": stage, "key": key, "event": "built", "pid": os.getpid()})
            log.info("stage %s wrote %s (%d files)", stage, final, len(files))
            if self.shared is not None:
                manifest = self._share(manifest)
            return manifest, False

    def _heal(self, hit: Manifest, build: Callable[[Path], BuildResult | None]) -> Manifest:
        """Rebuild an artifact whose files retention pruned and put the pruned files back.

        Two runs can share a prefix of artifacts (same config and inputs up to a step: the AQN arm of
        an ablation equals the no-AQN arm while sigma is 0); retention of the run that made them may
        prune a checkpoint the other run must continue from. Each rebuilt file is checked against the
        sha256 its manifest kept and only then moved in, and ``pruned`` forgets it (the CPU trainer
        is deterministic). A rebuild that gives other bytes (GPU kernels are not bit-reproducible)
        is *re-keyed* instead (``_rekey``): a new artifact, whose digest differs, so everything built
        on it gets new keys; the old manifest names it in ``extra["rekeyed_to"]`` and the next heal of
        the old key returns it while it is whole.
        """
        with self.lock(f"{hit.stage}-{hit.key}"):
            directory = self.path_for(hit.stage, hit.key)
            manifest = Manifest.load(directory)
            if not manifest.pruned:  # healed meanwhile by another process
                manifest.path = str(directory)
                return manifest
            if (to := manifest.extra.get(REKEYED_TO)) and (
                done := self._get_local(hit.stage, to, None, False)
            ) is not None:
                return self._heal(done, build) if done.pruned else done  # re-keyed before: that one
            tmp = self.root / TMP_DIR / f"heal-{hit.stage}-{hit.key}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            try:
                result = build(tmp) or BuildResult()
                differ = {
                    name: sha256_file(tmp / name) if (tmp / name).is_file() else "missing"
                    for name in manifest.pruned
                }
                differ = {n: got for n, got in differ.items() if got != manifest.files[n].sha256}
                if differ:
                    return self._rekey(manifest, tmp, result, differ)
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

    def _rekey(self, old: Manifest, tmp: Path, result: BuildResult, differ: dict[str, str]) -> Manifest:
        """Store a rebuild of ``old`` whose bytes differ as a new artifact (caller holds old's lock).

        Its key is derived from the old one (a second heal of the old key finds it), its manifest
        keeps the old config and inputs and says what it replaces (``extra["rekeyed_from"]``); the
        old manifest gets ``extra["rekeyed_to"]``. Journaled as ``rekeyed`` in gc.jsonl."""
        key = sha256_json({"stage": old.stage, "rekeyed_from": old.key})[:32]
        what = ", ".join(
            f"{n} (sha256 {got[:12]}, recorded {old.files[n].sha256[:12]})" for n, got in differ.items()
        )
        with self.lock(f"{old.stage}-{key}"):
            final = self.path_for(old.stage, key)
            if self._get_local(old.stage, key, None, True) is None:  # else a crash before rekeyed_to
                files = {str(p.relative_to(tmp)): file_record(p) for p in tree_files(tmp)}
                extra = {
                    **result.extra,
                    "rekeyed_from": old.key,
                    "rekey_reason": f"rebuild gave other bytes: {what}",
                }
                fresh = old.model_copy(
                    update={
                        "key": key, "files": files, "pruned": {}, "mode": result.mode or old.mode,
                        "metrics": result.metrics or old.metrics, "extra": extra,
                        "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                    }
                )  # fmt: skip
                atomic_write_text(tmp / MANIFEST, fresh.model_dump_json(indent=2))
                self._discard(final)
                os.replace(tmp, final)
                fsync_dir(final.parent)
            old.extra[REKEYED_TO] = key
            atomic_write_text(old.dir / MANIFEST, old.model_dump_json(indent=2))
        made = Manifest.load(final)
        self._journal(
            {"stage": old.stage, "key": old.key, "event": "rekeyed", "to": key, "files": sorted(differ)},
            GC_LOG,
        )
        log.warning(
            "stage %s: the rebuild of %s/%s gave other bytes (%s): re-keyed as %s",
            old.stage,
            old.stage,
            old.key,
            what,
            key,
        )
        return made

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
            try:
                memo = read_json(memo_path) if memo_path.is_file() else {}
            except ValueError as err:  # a memo of derived values: rebuilt, said in the log
                log.warning("%s: the source digest memo starts again", err)
                memo = {}
            if memo.get(str(path), {}).get("fingerprint") == fingerprint:
                return memo[str(path)]["digest"]
            base = path if path.is_dir() else path.parent
            digest = sha256_json({str(p.relative_to(base)): sha256_file(p) for p in files})
            memo[str(path)] = {"fingerprint": fingerprint, "digest": digest}
            atomic_write_json(memo_path, memo)
        return digest


def open_store(work: str | Path, store_cfg: Any = None) -> ArtifactStore:
    """The store of the work directory ``work``: this machine's cache of the shared store that
    ``store_cfg.uri`` names (the run config's ``store`` section), or a local-only store without one."""
    return ArtifactStore(Path(work) / STORE_DIR, open_shared(getattr(store_cfg, "uri", None)))
