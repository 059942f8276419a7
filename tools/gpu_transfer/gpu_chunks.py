#!/usr/bin/env python3
"""The chunked archive that carries a trimmed vLLM to the GPU machine, and its checks there. Standard
library only: it runs here (Python 3.11) and on the GPU image (Python 3.12, nothing installed for it).

`pack` tars a staged tree (sorted, owners and times normalised, so the same tree gives the same
archive), compresses it with xz, splits it into numbered chunks `part-NN` of at most `chunk_bytes`, and
writes `manifest.json`: each chunk's size and sha256, the whole archive's size and sha256, and what the
caller adds (gpu_bundle.py build records the wheels, the dropped files and the import scan). Only the
chunks are kept; `unpack` reassembles the archive.

On the GPU machine, where each device call carries at most 64 MiB and a warm machine keeps ignored
folders between calls, `stage` moves the chunks one call carried into a kept folder and names the
chunks still missing (what the next call must carry); `verify` checks a folder against its manifest;
`unpack` verifies, reassembles, checks the whole archive's sum, and extracts with tarfile's data filter
(no absolute paths, no links out of the tree, no device files) into a target folder, atomically.

Exit status of verify/stage/unpack: 0 complete and sound, 3 chunks missing, 4 a chunk or the archive
corrupt, 2 usage or manifest errors.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path

MiB = 2**20
MANIFEST = "manifest.json"
ARCHIVE = "bundle.tar.xz"
CHUNK_RE = re.compile(r"^part-(\d{2,})$")
EXIT_MISSING, EXIT_CORRUPT, EXIT_USAGE = 3, 4, 2


def human(n: float) -> str:
    return f"{n / MiB:.2f} MiB"


def sha256_file(path: Path, bufsize: int = 4 * MiB) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0  # the same tree gives the same archive
    return None if "__pycache__" in info.name.split("/") else info


def pack(src: Path, out: Path, chunk_bytes: int, preset: int, meta: dict | None = None) -> dict:
    """tar.xz the tree's contents (sorted, normalised owners and times), split it, write the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if CHUNK_RE.match(old.name) or old.name in (MANIFEST, ARCHIVE):
            old.unlink()
    archive = out / ARCHIVE
    t0 = time.perf_counter()
    raw = 0
    with (
        lzma.open(archive, "wb", preset=preset) as xz,
        tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for path in sorted(src.rglob("*")):
            if path.is_dir() and not path.is_symlink():
                continue
            rel = path.relative_to(src).as_posix()
            if "__pycache__" in rel.split("/"):
                continue
            raw += path.lstat().st_size
            tar.add(path, arcname=rel, recursive=False, filter=_tar_filter)
    seconds = time.perf_counter() - t0
    size = archive.stat().st_size
    chunks = []
    with open(archive, "rb") as f:
        k = 0
        while data := f.read(chunk_bytes):
            k += 1
            name = f"part-{k:02d}"
            (out / name).write_bytes(data)
            chunks.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {
        "format": "qerl-gpu-bundle/1",
        "archive": {"name": ARCHIVE, "bytes": size, "sha256": sha256_file(archive), "compression": f"xz preset {preset}",
                    "uncompressed_tar_payload_bytes": raw, "compress_seconds": round(seconds, 1)},
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        **(meta or {}),
    }  # fmt: skip
    archive.unlink()  # the chunks are the archive; unpack reassembles it
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def print_summary(manifest: dict) -> None:
    """One line: payload, archive, compression and the chunks' sizes."""
    a = manifest["archive"]
    print(f"gpu_bundle: {human(a['uncompressed_tar_payload_bytes'])} -> {human(a['bytes'])} ({a['compression']}, "
          f"{a['compress_seconds']} s) in {len(manifest['chunks'])} chunks: "
          + ", ".join(f"{c['name']} {human(c['bytes'])}" for c in manifest["chunks"]), file=sys.stderr)  # fmt: skip


def load_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise SystemExit(f"gpu_bundle: no {MANIFEST} in {folder} (carry it with every chunk)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != "qerl-gpu-bundle/1":
        raise SystemExit(f"gpu_bundle: {path} is not a qerl-gpu-bundle/1 manifest")
    return manifest


def verify(folder: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """(missing, corrupt) chunk names: absent, or of the wrong size or sha256."""
    missing, corrupt = [], []
    for c in manifest["chunks"]:
        path = folder / c["name"]
        if not path.is_file():
            missing.append(c["name"])
        elif path.stat().st_size != c["bytes"] or sha256_file(path) != c["sha256"]:
            corrupt.append(c["name"])
    return missing, corrupt


def report(folder: Path, manifest: dict, missing: list[str], corrupt: list[str]) -> int:
    n = len(manifest["chunks"])
    for name in corrupt:
        c = next(c for c in manifest["chunks"] if c["name"] == name)
        print(f"gpu_bundle: CORRUPT chunk {folder / name}: size or sha256 differs from the manifest "
              f"({c['bytes']} bytes, sha256 {c['sha256'][:16]}...): carry it again", file=sys.stderr)  # fmt: skip
    if missing:
        print(
            f"gpu_bundle: MISSING {len(missing)} of {n} chunks in {folder}: {' '.join(missing)}",
            file=sys.stderr,
        )
        carry = manifest.get("carry_dir", ".gpu-vllm")  # where the build put the chunks
        print(
            "gpu_bundle: carry next: "
            + json.dumps([f"{carry}/{m}" for m in missing[:1]] + [f"{carry}/{MANIFEST}"]),
            file=sys.stderr,
        )
    if corrupt:
        return EXIT_CORRUPT
    if missing:
        return EXIT_MISSING
    print(f"gpu_bundle: all {n} chunks present and sound in {folder}", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    manifest = load_manifest(folder)
    return report(folder, manifest, *verify(folder, manifest))


def cmd_stage(args: argparse.Namespace) -> int:
    """Move carried chunks from --from into the kept folder --to (a sound chunk replaces nothing that
    is already sound; a corrupt carried chunk is named and left where it is)."""
    src, dst = Path(args.src), Path(args.to)
    dst.mkdir(parents=True, exist_ok=True)
    if (src / MANIFEST).is_file():
        new = load_manifest(src)
        if (dst / MANIFEST).is_file() and load_manifest(dst)["archive"]["sha256"] != new["archive"]["sha256"]:
            print(
                "gpu_bundle: the carried manifest is for another bundle: dropping the staged chunks",
                file=sys.stderr,
            )
            for old in dst.iterdir():
                if CHUNK_RE.match(old.name):
                    old.unlink()
        shutil.copyfile(src / MANIFEST, dst / MANIFEST)
    manifest = load_manifest(dst)
    by_name = {c["name"]: c for c in manifest["chunks"]}
    moved, bad = [], []
    for path in sorted(src.glob("part-*")) if src.is_dir() else []:
        c = by_name.get(path.name)
        if c and path.stat().st_size == c["bytes"] and sha256_file(path) == c["sha256"]:
            shutil.move(str(path), str(dst / path.name))
            moved.append(path.name)
        else:
            bad.append(path.name)
    if moved:
        print(f"gpu_bundle: staged {' '.join(moved)} into {dst}", file=sys.stderr)
    for name in bad:
        print(f"gpu_bundle: CORRUPT carried chunk {src / name} (not staged): carry it again", file=sys.stderr)
    missing, corrupt = verify(dst, manifest)
    have = [c["name"] for c in manifest["chunks"] if c["name"] not in missing and c["name"] not in corrupt]
    print(f"gpu_bundle: staged so far: {' '.join(have) or 'none'}", file=sys.stderr)
    rc = report(dst, manifest, missing, corrupt)
    return EXIT_CORRUPT if bad else rc


def cmd_unpack(args: argparse.Namespace) -> int:
    folder, dest = Path(args.dir), Path(args.dest)
    manifest = load_manifest(folder)
    stamp = dest / ".bundle-sha256"
    if stamp.is_file() and stamp.read_text().strip() == manifest["archive"]["sha256"] and not args.force:
        print(f"gpu_bundle: {dest} already holds this bundle", file=sys.stderr)
        return 0
    rc = report(folder, manifest, *verify(folder, manifest))
    if rc:
        return rc
    t0 = time.perf_counter()
    h = hashlib.sha256()
    buf = io.BytesIO()
    for c in manifest["chunks"]:
        data = (folder / c["name"]).read_bytes()
        h.update(data)
        buf.write(data)
    if h.hexdigest() != manifest["archive"]["sha256"] or buf.tell() != manifest["archive"]["bytes"]:
        print("gpu_bundle: CORRUPT archive: the reassembled chunks do not give the manifest's sha256 "
              "(the manifest and the chunks come from different builds?)", file=sys.stderr)  # fmt: skip
        return EXIT_CORRUPT
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    buf.seek(0)
    with lzma.open(buf) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, filter="data")
        else:  # Python < 3.11.4: refuse absolute or escaping names ourselves
            for member in tar:
                if (
                    member.name.startswith("/")
                    or ".." in member.name.split("/")
                    or not (member.isfile() or member.isdir())
                ):
                    raise SystemExit(f"gpu_bundle: unsafe member {member.name!r}")
                tar.extract(member, tmp)
    (tmp / ".bundle-sha256").write_text(manifest["archive"]["sha256"] + "\n")
    os.replace(tmp, dest)
    print(f"gpu_bundle: extracted {human(manifest['archive']['bytes'])} into {dest} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)  # fmt: skip
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    meta: dict = {}
    for item in args.meta or []:
        key, _, path = item.partition("=")
        meta[key] = json.loads(Path(path).read_text())
    for item in args.set or []:
        key, _, value = item.partition("=")
        meta[key] = value
    if args.chunk_mib > 60:
        print(
            "gpu_bundle: chunks over 60 MiB leave no room for the working tree in a 64 MiB call",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print_summary(pack(Path(args.src), Path(args.out), int(args.chunk_mib * MiB), args.preset, meta))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The subcommands of this module, for gpu_bundle.py's command line."""
    p = sub.add_parser("pack", help="tar + xz + split + manifest")
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--chunk-mib", type=float, default=50.0)
    p.add_argument("--preset", type=int, default=6, help="xz preset 0-9 (| 0x80000000 for extreme)")
    p.add_argument("--meta", action="append", help="KEY=FILE.json: add to the manifest")
    p.add_argument("--set", action="append", help="KEY=VALUE: add to the manifest")
    p.set_defaults(func=cmd_pack)
    p = sub.add_parser("verify", help="check chunks against the manifest")
    p.add_argument("--dir", required=True)
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("stage", help="move carried chunks into a kept folder")
    p.add_argument("--from", dest="src", required=True)
    p.add_argument("--to", required=True)
    p.set_defaults(func=cmd_stage)
    p = sub.add_parser("unpack", help="verify, reassemble and extract")
    p.add_argument("--dir", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_unpack)
