#!/usr/bin/env python3
"""Carry a trimmed vLLM to the GPU machine in pieces: the command line, and the build here. Standard
library only: it runs here (Python 3.11, the project's venv) and on the GPU image (Python 3.12,
nothing installed for it). Its sibling modules hold the two halves that run apart: gpu_imports.py
(the static import scan, here) and gpu_chunks.py (the chunked archive, and its checks there).

Subcommands:
  build     what `fetch_gpu_wheels.sh --vllm` runs: unwheel the pinned wheels, drop the globs of the
            drop list (failing on a pattern that matches nothing: a changed vLLM), defer the
            annotations of the listed modules (gpu_lazy.py: lazily loaded packages they name only
            in annotations stay out), check with the import scan that the staged tree is closed
            (nothing needed that neither it nor the image holds), and pack it, recording wheels,
            dropped files, deferred modules and the scan in the manifest.
  unwheel   unpack wheels into a staging folder the way an installer lays them out (purelib/platlib
            data folders merged, scripts and headers left out), with their .dist-info.
  drop      delete files matching globs (one per line in a file, `#` comments) from a staged tree.
  scan      the static import closure of a source tree (gpu_imports.py).
  pack, verify, stage, unpack
            the chunked archive (gpu_chunks.py); stage and unpack run on the GPU machine.

Exit status of verify/stage/unpack: 0 complete and sound, 3 chunks missing, 4 a chunk or the archive
corrupt, 2 usage or manifest errors.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import shutil
import sys
import time
import zipfile
from pathlib import Path

import gpu_chunks
import gpu_imports
from gpu_chunks import MiB, human, pack, print_summary
from gpu_imports import dist_map_from_wheels, image_packages, map_externals, norm, scan
from gpu_lazy import defer_annotations, defers_annotations, eager_lazy_modules


def unwheel(wheels: list[Path], dest: Path) -> list[dict]:
    """Unpack wheels like an installer into dest; returns [{dist, version, wheel}]."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = []
    for whl in wheels:
        name, version = whl.name.split("-")[:2]
        with zipfile.ZipFile(whl) as zf:
            for info in zf.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: not needed for imports
                    parts = parts[2:]
                if info.is_dir() or ".." in parts or info.filename.startswith("/"):
                    continue
                target = dest.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 4 * MiB)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(target, mode | 0o600)
        rows.append({"dist": norm(name), "version": version, "wheel": whl.name})
    return rows


def read_list(path: Path) -> list[str]:
    """Lines of a list file, with `#` comments and blanks removed."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def drop(tree: Path, patterns: list[str]) -> list[dict]:
    """Delete the files of tree whose relative path matches a glob; returns [{path, bytes}]."""
    dropped = []
    for path in sorted(p for p in tree.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(tree).as_posix()
        if any(fnmatch.fnmatchcase(rel, pat) for pat in patterns):
            dropped.append({"path": rel, "bytes": path.lstat().st_size})
            path.unlink()
    for d in sorted((p for p in tree.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return dropped


def cmd_unwheel(args: argparse.Namespace) -> int:
    rows = unwheel([Path(w) for w in args.wheels], Path(args.dest))
    for r in rows:
        print(f"  {r['dist']} {r['version']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    patterns = read_list(Path(args.list))
    dropped = drop(Path(args.tree), patterns)
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(d["path"], p) for d in dropped)]
    total = sum(d["bytes"] for d in dropped)
    print(f"drop: {len(dropped)} files, {human(total)}", file=sys.stderr)
    if unused:
        print(f"drop: patterns that matched nothing: {unused}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"patterns": patterns, "files": dropped}, indent=1) + "\n")
    return 1 if unused and args.strict else 0


def parse_requirements(path: Path) -> list[dict]:
    """`name==version  # reason` lines -> [{dist, version, reason}] (only exact pins are accepted)."""
    rows = []
    for line in path.read_text().splitlines():
        spec, _, reason = line.partition("#")
        spec = spec.strip()
        if not spec:
            continue
        name, sep, version = spec.partition("==")
        if not sep or not version.strip():
            raise SystemExit(f"gpu_bundle: {path}: '{spec}' is not an exact pin (name==version)")
        name = name.split("[")[0].strip()  # extras choose dependencies, not the distribution
        rows.append({"dist": norm(name), "version": version.strip(), "reason": reason.strip()})
    return rows


def match_wheels(reqs: list[dict], wheel_dir: Path) -> list[Path]:
    """The one wheel of each pinned requirement in wheel_dir (others there are ignored)."""
    by_key: dict[tuple[str, str], list[Path]] = {}
    for whl in wheel_dir.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        by_key.setdefault((norm(name), version), []).append(whl)
    out, problems = [], []
    for r in reqs:
        found = by_key.get((r["dist"], r["version"]), [])
        if len(found) != 1:
            problems.append(f"{r['dist']}=={r['version']}: {len(found)} wheels in {wheel_dir}")
        else:
            out.append(found[0])
    if problems:
        raise SystemExit("gpu_bundle: " + "; ".join(problems))
    return out


def provided_dists(manifests: list[str]) -> dict[str, str]:
    """Distribution -> version of what other bundles carry (their manifests' dependency lists)."""
    out: dict[str, str] = {}
    for path in manifests:
        manifest = json.loads(Path(path).read_text())
        if manifest.get("format") != "qerl-gpu-bundle/1":
            raise SystemExit(f"gpu_bundle: {path} is not a qerl-gpu-bundle/1 manifest")
        out.update({d["dist"]: d["version"] for d in manifest.get("dependencies", [])})
    return out


def resolved_wheels(
    reqs: list[dict], wheel_dir: Path, image: set[str], provided: dict[str, str]
) -> tuple[list[Path], dict[str, list[str]]]:
    """Every wheel of a resolved folder (pip download of the pins, dependencies included) except the
    image's distributions and those another bundle provides: (wheels to carry, what is left out)."""
    by_dist: dict[str, list[Path]] = {}
    for whl in sorted(wheel_dir.glob("*.whl")):
        by_dist.setdefault(norm(whl.name.split("-")[0]), []).append(whl)
    several = {d: [w.name for w in ws] for d, ws in by_dist.items() if len(ws) > 1}
    if several:
        raise SystemExit(f"gpu_bundle: several versions in {wheel_dir} (a pin changed? empty the folder "
                         f"and fetch again): {several}")  # fmt: skip
    version = {d: ws[0].name.split("-")[1] for d, ws in by_dist.items()}
    problems = [f"{r['dist']}=={r['version']} (found {version.get(r['dist'], 'none')})"
                for r in reqs if version.get(r["dist"]) != r["version"]]  # fmt: skip
    clash = [f"{d} {version[d]} (the other bundle has {provided[d]})"
             for d in by_dist if d in provided and provided[d] != version[d]]  # fmt: skip
    if problems or clash:
        raise SystemExit(f"gpu_bundle: the resolved folder {wheel_dir} does not match: pins {problems}, "
                         f"versions another bundle provides differently {clash}")  # fmt: skip
    left_out = {
        "image": sorted(f"{d}=={version[d]}" for d in by_dist if d in image),
        "other bundles": sorted(f"{d}=={version[d]}" for d in by_dist if d in provided and d not in image),
    }
    carry = [ws[0] for d, ws in sorted(by_dist.items()) if d not in image and d not in provided]
    return carry, left_out


def _drop_checked(stage: Path, drop_list: Path) -> tuple[list[str], list[dict]]:
    """Apply the drop list; a pattern that matches nothing is an error (the packages changed)."""
    patterns = read_list(drop_list)
    dropped = drop(stage, patterns)
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(d["path"], p) for d in dropped)]
    if unused:
        raise SystemExit(f"gpu_bundle: drop patterns that matched nothing (a changed package?): {unused}")
    return patterns, dropped


def _defer_checked(stage: Path, listing: Path) -> list[str]:
    """``from __future__ import annotations`` into each listed module (tools/gpu_transfer/gpu_lazy.py), each of
    which must exist, lack it, and use its lazy modules in annotations only."""
    done = []
    for rel in read_list(listing):
        path = stage / rel
        if not path.is_file():
            raise SystemExit(f"gpu_bundle: {listing}: {rel} is not in the staged tree (a changed package?)")
        tree = ast.parse(path.read_bytes())
        if defers_annotations(tree):
            raise SystemExit(f"gpu_bundle: {listing}: {rel} already defers its annotations")
        uses = eager_lazy_modules(tree)
        if not uses or not all(uses.values()):
            raise SystemExit(f"gpu_bundle: {listing}: {rel} uses lazy modules {uses or 'none'} at import "
                             "time beyond annotations (True = annotations only): deferring would not help")  # fmt: skip
        defer_annotations(path)
        done.append(rel)
    print(f"gpu_bundle: deferred the annotations of {len(done)} modules", file=sys.stderr)
    return done


def _scan_check(stage: Path, roots_file: Path, reqs: list[dict], image: set[str], wheel_dir: Path) -> dict:
    """The import scan of the staged tree from the roots: fails unless it is closed (nothing needed
    that neither the tree nor the image holds); returns what the manifest records of it."""
    roots = read_list(roots_file)
    result = scan([stage], roots)
    map_externals(result, image, wheel_dir, False)
    needed = sorted(
        {e["dist"] for e in result["externals"].values() if not e["in_image"] and e["kind"] == "needed"}
    )
    absent = sorted(m for m, v in result["missing"].items() if not v["guard"])
    if needed or absent:
        raise SystemExit(
            f"gpu_bundle: the staged tree is not closed: needed {needed}, absent modules {absent}"
        )
    top_to_dist = dist_map_from_wheels(wheel_dir)
    reached_dists = {top_to_dist.get(top, norm(top)) for top in result["packages"]}
    return {
        "roots": roots,
        "modules_reached": len(result["reached"]),
        "extensions_unguarded": result["core_extensions"],
        "extensions_reached": result["extensions"],
        "image_dists_used": sorted({e["dist"] for e in result["externals"].values() if e["in_image"]}),
        "conditional": {k: e["guards"] for k, e in result["externals"].items() if e["kind"] == "conditional"},
        "not_reached_at_import": sorted(r["dist"] for r in reqs if r["dist"] not in reached_dists),
    }


def cmd_build(args: argparse.Namespace) -> int:
    """unwheel + drop + scan check + pack, with everything the manifest records. Two ways to choose
    the wheels: exact pins (each line of --requirements, vLLM's bundle, checked by the import scan),
    or --resolved (the whole folder pip resolved from the pins, less the image and --provided)."""
    reqs = parse_requirements(Path(args.requirements))
    image = image_packages()
    wheel_dir = Path(args.wheels)
    left_out: dict[str, list[str]] = {}
    if args.resolved:
        wheels, left_out = resolved_wheels(reqs, wheel_dir, image, provided_dists(args.provided))
    else:
        wheels = match_wheels(reqs, wheel_dir)
        clash = [r["dist"] for r in reqs if r["dist"] in image]
        if clash and not args.allow_image_dists:
            raise SystemExit(f"gpu_bundle: {clash} are in the GPU image: carrying them would shadow the "
                             "image's (vLLM must use the image's torch and friends)")  # fmt: skip
    stage, out = Path(args.stage), Path(args.out)
    if stage.exists():
        shutil.rmtree(stage)
    t0 = time.perf_counter()
    rows = unwheel(wheels, stage)
    patterns, dropped = _drop_checked(stage, Path(args.drop))
    deferred = _defer_checked(stage, Path(args.defer_annotations)) if args.defer_annotations else []
    scanned = _scan_check(stage, Path(args.roots), reqs, image, wheel_dir) if args.roots else None
    print(f"gpu_bundle: staged {len(rows)} wheels in {time.perf_counter() - t0:.0f} s; "
          f"dropped {len(dropped)} files, {human(sum(d['bytes'] for d in dropped))}", file=sys.stderr)  # fmt: skip
    reasons = {r["dist"]: r["reason"] for r in reqs}
    meta = {
        "vllm_version": next((r["version"] for r in rows if r["dist"] == "vllm"), None),
        "python": args.python,
        "dependencies": [{**r, "reason": reasons.get(r["dist"], "")} for r in rows],
        "dropped": {"patterns": patterns, "bytes": sum(d["bytes"] for d in dropped), "files": dropped},
        **({"deferred_annotations": deferred} if deferred else {}),
        **({"not_reached_at_import": scanned.pop("not_reached_at_import"), "scan": scanned} if scanned else {}),
        **({"resolved_from": [f"{r['dist']}=={r['version']}" for r in reqs], "left_out": left_out}
           if args.resolved else {}),
        "carry_dir": out.as_posix() if not out.is_absolute() else out.name,  # the device calls' carry
        "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    print_summary(pack(stage, out, int(args.chunk_mib * MiB), args.preset, meta))
    if not args.keep_stage:
        shutil.rmtree(stage)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    gpu_imports.add_parsers(sub)
    gpu_chunks.add_parsers(sub)
    p = sub.add_parser("unwheel", help="unpack wheels into a staging folder")
    p.add_argument("--dest", required=True)
    p.add_argument("--json")
    p.add_argument("wheels", nargs="+")
    p.set_defaults(func=cmd_unwheel)
    p = sub.add_parser("drop", help="delete files matching the globs of a list file")
    p.add_argument("--tree", required=True)
    p.add_argument("--list", required=True)
    p.add_argument("--json")
    p.add_argument("--strict", action="store_true", help="fail when a pattern matches nothing")
    p.set_defaults(func=cmd_drop)
    p = sub.add_parser(
        "build", help="unwheel + drop + scan check + pack (what fetch_gpu_wheels.sh --vllm runs)"
    )
    p.add_argument("--wheels", required=True, help="folder holding the pinned wheels")
    p.add_argument("--requirements", required=True, help="name==version  # reason lines")
    p.add_argument("--drop", required=True, help="globs of files to leave out")
    p.add_argument(
        "--defer-annotations", help="modules (paths in the tree) to give `from __future__ import annotations`"
    )
    p.add_argument("--roots", help="root modules of the import scan (without: no scan)")
    p.add_argument(
        "--resolved",
        action="store_true",
        help="carry every wheel of --wheels (pip's resolution of the pins) but the image's",
    )
    p.add_argument(
        "--provided",
        action="append",
        default=[],
        metavar="MANIFEST",
        help="with --resolved: another bundle's manifest; its distributions are not carried",
    )
    p.add_argument("--stage", required=True, help="staging folder (emptied first)")
    p.add_argument("--out", required=True, help="chunks and manifest.json go here")
    p.add_argument("--chunk-mib", type=float, default=50.0)
    p.add_argument("--preset", type=int, default=6)
    p.add_argument("--python", default="3.12")
    p.add_argument("--keep-stage", action="store_true")
    p.add_argument("--allow-image-dists", action="store_true")
    p.set_defaults(func=cmd_build)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
