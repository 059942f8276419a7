"""The bundles' machinery (tools/gpu_transfer/gpu_bundle.py), on small synthetic trees, with no network.

The split, the staging of carried chunks (by gpu_bundle.py, and by gpu_offline.sh --stage-only as the
GPU machine runs it), the reassembly and the checksum checks: a missing chunk is named, a flipped byte
is detected and the chunk named, the reassembled archive extracts to the same files. The import scan on a tiny synthetic package: module-level imports are found (in `if`, `try`,
class bodies), function-level and TYPE_CHECKING imports are not, relative imports resolve, names map to
distributions (a wheel's top_level.txt, the table), the image's distributions are subtracted. And the
committed lists the shell script reads stay consistent (exact pins; pydantic equal to the small
wheel set's pins; the drop list never removes what the scan found imported unguarded).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tools" / "gpu_transfer"
SCRIPT = SCRIPTS / "gpu_bundle.py"
sys.path.insert(0, str(SCRIPTS))  # the scripts import their siblings, as they do when run
import gpu_bundle as gb  # noqa: E402
import gpu_chunks as gc  # noqa: E402
import gpu_imports as gi  # noqa: E402


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def synthetic(tmp_path):
    """A small tree: text that compresses, random bytes that do not, an executable, nested folders."""
    src = tmp_path / "site"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("x = 1\n" * 2000)
    (src / "pkg" / "sub" / "blob.so").write_bytes(os.urandom(300_000))
    tool = src / "pkg" / "tool"
    tool.write_bytes(b"#!/bin/sh\necho hi\n")
    tool.chmod(0o755)
    (src / "pkg-1.0.dist-info").mkdir()
    (src / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\nVersion: 1.0\n")
    (src / "pkg" / "__pycache__").mkdir()
    (src / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"stale")
    out = tmp_path / "out"
    manifest = gc.pack(src, out, chunk_bytes=100_000, preset=1, meta={"vllm_version": "test"})
    return src, out, manifest


def test_pack_splits_into_numbered_chunks_with_a_manifest(synthetic):
    src, out, manifest = synthetic
    chunks = manifest["chunks"]
    assert len(chunks) >= 3, "the random payload must need several 100 kB chunks"
    assert [c["name"] for c in chunks] == [f"part-{k:02d}" for k in range(1, len(chunks) + 1)]
    assert all(c["bytes"] <= 100_000 for c in chunks) and chunks[0]["bytes"] == 100_000
    for c in chunks:
        assert hashlib.sha256((out / c["name"]).read_bytes()).hexdigest() == c["sha256"]
    whole = b"".join((out / c["name"]).read_bytes() for c in chunks)
    assert len(whole) == manifest["archive"]["bytes"]
    assert hashlib.sha256(whole).hexdigest() == manifest["archive"]["sha256"]
    on_disk = json.loads((out / "manifest.json").read_text())
    assert (
        on_disk == manifest and on_disk["format"] == "qerl-gpu-bundle/1" and on_disk["vllm_version"] == "test"
    )
    assert not (out / gc.ARCHIVE).exists(), "only the chunks travel"


def test_reassembled_archive_extracts_to_the_same_files(synthetic, tmp_path):
    src, out, _ = synthetic
    dest = tmp_path / "extracted"
    assert gb.main(["unpack", "--dir", str(out), "--dest", str(dest)]) == 0
    want = {k: v for k, v in _tree(src).items() if "__pycache__" not in k}
    got = {k: v for k, v in _tree(dest).items() if k != ".bundle-sha256"}
    assert got == want
    assert os.access(dest / "pkg" / "tool", os.X_OK), "modes survive (binaries must stay executable)"
    # a second unpack of the same bundle is a no-op (the stamp matches)
    (dest / "marker").write_text("kept")
    assert gb.main(["unpack", "--dir", str(out), "--dest", str(dest)]) == 0
    assert (dest / "marker").exists()


def test_a_missing_chunk_is_named_and_nothing_extracts(synthetic, tmp_path, capsys):
    _, out, manifest = synthetic
    last = manifest["chunks"][-1]["name"]
    (out / "part-02").unlink()
    (out / last).unlink()
    assert gc.verify(out, manifest) == (["part-02", last], [])
    rc = gb.main(["unpack", "--dir", str(out), "--dest", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == gc.EXIT_MISSING
    assert f"MISSING 2 of {len(manifest['chunks'])} chunks" in err and f"part-02 {last}" in err
    assert '".gpu-vllm/part-02"' in err, "the next call's carry is spelled out"
    assert not (tmp_path / "x").exists()


def test_a_flipped_byte_is_detected_and_the_chunk_named(synthetic, tmp_path, capsys):
    _, out, manifest = synthetic
    path = out / "part-02"
    data = bytearray(path.read_bytes())
    data[12345] ^= 0x01
    path.write_bytes(bytes(data))
    assert gc.verify(out, manifest) == ([], ["part-02"])
    rc = gb.main(["unpack", "--dir", str(out), "--dest", str(tmp_path / "x")])
    assert rc == gc.EXIT_CORRUPT
    assert "CORRUPT chunk" in capsys.readouterr().err and "part-02" in str(path)
    assert not (tmp_path / "x").exists()


def test_chunks_from_another_build_fail_the_whole_archive_check(synthetic, tmp_path, capsys):
    """Each chunk matches its own line, but the manifest's archive sum does not: refuse to extract."""
    _, out, manifest = synthetic
    manifest["archive"]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert gb.main(["unpack", "--dir", str(out), "--dest", str(tmp_path / "x")]) == gc.EXIT_CORRUPT
    assert "CORRUPT archive" in capsys.readouterr().err


def test_stage_collects_one_chunk_per_call_into_the_kept_folder(synthetic, tmp_path, capsys):
    """The device sequence: each call carries manifest + one chunk; stage moves it into the kept
    folder and names what is still missing; the last call completes it."""
    _, out, manifest = synthetic
    names = [c["name"] for c in manifest["chunks"]]
    kept = tmp_path / "kept"
    for k, name in enumerate(names, start=1):
        carried = tmp_path / f"carried{k}"
        carried.mkdir()
        (carried / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
        (carried / name).write_bytes((out / name).read_bytes())
        rc = gb.main(["stage", "--from", str(carried), "--to", str(kept)])
        err = capsys.readouterr().err
        assert not (carried / name).exists() and (kept / name).exists()
        if k < len(names):
            assert rc == gc.EXIT_MISSING and f"MISSING {len(names) - k} of {len(names)}" in err
            assert " ".join(names[k:]) in err
        else:
            assert rc == 0 and "all" in err
    dest = tmp_path / "site"
    assert gb.main(["unpack", "--dir", str(kept), "--dest", str(dest)]) == 0
    assert (dest / "pkg" / "__init__.py").exists()


KIT_FILES = (
    "gpu_offline.sh",
    "gpu_bundle.py",
    "gpu_chunks.py",
    "gpu_imports.py",
    "gpu_lazy.py",
    "gpu_image_packages.txt",
)


def _device_root(tmp_path: Path, leave_out: str = "") -> tuple[Path, dict]:
    """A throwaway repository root holding the transfer kit's staging scripts, and the environment to
    run them in."""
    root = tmp_path / "device-root"
    (root / "tools" / "gpu_transfer").mkdir(parents=True)
    for name in KIT_FILES:
        if name != leave_out:
            (root / "tools" / "gpu_transfer" / name).write_bytes((SCRIPTS / name).read_bytes())
    return root, {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "results")}


def _stage_only(root: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(root / "tools" / "gpu_transfer" / "gpu_offline.sh"), "--stage-only"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def test_the_kit_stages_one_chunk_a_call_then_extracts(synthetic, tmp_path):
    """gpu_offline.sh --stage-only as the GPU machine's calls run it, in a throwaway root holding the
    kit's scripts: each call carries the manifest and one chunk into .gpu-vllm/; the kit keeps them in
    .gpu-vllm-chunks/, names what is missing, and extracts once every chunk is there and sound."""
    _, out, manifest = synthetic
    root, env = _device_root(tmp_path)
    names = [c["name"] for c in manifest["chunks"]]
    for k, name in enumerate(names):
        carried = root / ".gpu-vllm"
        carried.mkdir(exist_ok=True)
        for f in ("manifest.json", name):  # what one call's carry brings
            (carried / f).write_bytes((out / f).read_bytes())
        proc = _stage_only(root, env)
        assert proc.returncode == 0, proc.stderr
        if k < len(names) - 1:
            assert f"staged so far: {' '.join(names[: k + 1])}" in proc.stderr
            assert f'".gpu-vllm/{names[k + 1]}"' in proc.stderr, "the next call's carry is named"
            assert "vLLM part skipped: chunks missing" in proc.stderr
            assert not (root / ".gpu-vllm-site").exists()
    assert "vLLM bundle extracted in .gpu-vllm-site" in proc.stderr
    site = root / ".gpu-vllm-site"
    assert (site / ".bundle-sha256").read_text().strip() == manifest["archive"]["sha256"]
    assert (site / "pkg" / "sub" / "blob.so").is_file() and (
        site / "pkg-1.0.dist-info" / "METADATA"
    ).is_file()


def test_the_kit_stages_the_run_bundle_beside_the_vllm_one(synthetic, tmp_path):
    """The run bundle (Prefect, MLflow, ...) travels in .gpu-run/ the same way, in a call that also
    carries a vLLM chunk; each bundle is staged and extracted into its own site folder."""
    src, out, manifest = synthetic
    run_src = tmp_path / "run-site"
    (run_src / "prefect").mkdir(parents=True)
    (run_src / "prefect" / "__init__.py").write_text("flow = None\n")
    run_out = tmp_path / "run-out"
    run_manifest = gc.pack(run_src, run_out, chunk_bytes=100_000, preset=1)
    root, env = _device_root(tmp_path)
    names = [c["name"] for c in manifest["chunks"]]
    for k, name in enumerate(names):
        (root / ".gpu-vllm").mkdir(exist_ok=True)
        for f in ("manifest.json", name):
            (root / ".gpu-vllm" / f).write_bytes((out / f).read_bytes())
        if k == len(names) - 1:  # the last call brings the run bundle too
            (root / ".gpu-run").mkdir()
            for f in ("manifest.json", "part-01"):
                (root / ".gpu-run" / f).write_bytes((run_out / f).read_bytes())
        proc = _stage_only(root, env)
        assert proc.returncode == 0, proc.stderr
        if k < len(names) - 1:
            assert "no run bundle carried" in proc.stderr
    assert "vLLM bundle extracted in .gpu-vllm-site" in proc.stderr
    assert "run bundle extracted in .gpu-run-site" in proc.stderr
    stamp = (root / ".gpu-run-site" / ".bundle-sha256").read_text().strip()
    assert stamp == run_manifest["archive"]["sha256"]
    assert (root / ".gpu-run-site" / "prefect" / "__init__.py").read_text() == "flow = None\n"
    assert (root / ".gpu-vllm-site" / "pkg" / "sub" / "blob.so").read_bytes() == (
        src / "pkg" / "sub" / "blob.so"
    ).read_bytes()


def test_the_kit_says_staging_failed_not_that_a_chunk_is_corrupt(synthetic, tmp_path):
    """A broken kit (here a module left out of the tree) is reported as such, with the error."""
    _, out, _ = synthetic
    root, env = _device_root(tmp_path, leave_out="gpu_chunks.py")
    (root / ".gpu-vllm").mkdir()
    for f in ("manifest.json", "part-01"):
        (root / ".gpu-vllm" / f).write_bytes((out / f).read_bytes())
    proc = _stage_only(root, env)
    assert proc.returncode == 1
    assert "staging failed (exit 1): ModuleNotFoundError: No module named 'gpu_chunks'" in proc.stderr
    assert "corrupt" not in proc.stderr


def test_stage_drops_chunks_of_an_older_bundle(synthetic, tmp_path, capsys):
    """A rebuilt bundle (new manifest) must not be completed with a staged chunk of the old one."""
    src, out, _ = synthetic
    kept = tmp_path / "kept"
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
    (carried / "part-01").write_bytes((out / "part-01").read_bytes())
    assert gb.main(["stage", "--from", str(carried), "--to", str(kept)]) == gc.EXIT_MISSING
    (src / "pkg" / "new.py").write_text("changed = True\n")
    out2 = tmp_path / "out2"
    gc.pack(src, out2, chunk_bytes=100_000, preset=1)
    (carried / "manifest.json").write_bytes((out2 / "manifest.json").read_bytes())
    (carried / "part-02").write_bytes((out2 / "part-02").read_bytes())
    capsys.readouterr()
    assert gb.main(["stage", "--from", str(carried), "--to", str(kept)]) == gc.EXIT_MISSING
    err = capsys.readouterr().err
    assert "another bundle" in err and "staged so far: part-02" in err
    assert not (kept / "part-01").exists()


def test_stage_refuses_a_corrupt_carried_chunk(synthetic, tmp_path, capsys):
    _, out, _ = synthetic
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
    (carried / "part-01").write_bytes(b"\0" + (out / "part-01").read_bytes()[1:])
    rc = gb.main(["stage", "--from", str(carried), "--to", str(tmp_path / "kept")])
    assert rc == gc.EXIT_CORRUPT
    assert "CORRUPT carried chunk" in capsys.readouterr().err
    assert not (tmp_path / "kept" / "part-01").exists()


# -- the import scan -------------------------------------------------------------------------------


@pytest.fixture
def tiny_pkg(tmp_path):
    tree = tmp_path / "tree"
    pkg = tree / "tinypkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import os\n"
        "import numpy as np\n"  # module level: found (in the image)
        "from . import core\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import mypy_only\n"  # never at run time
    )
    (pkg / "core.py").write_text(
        "import yaml\n"  # module level, import name != distribution name (pyyaml)
        "from .sub.helper import thing\n"
        "try:\n"
        "    import fancy_optional\n"  # guarded by ImportError: optional
        "except ImportError:\n"
        "    fancy_optional = None\n"
        "if USE_GPU:\n"
        "    import gpu_only_lib\n"  # module-level if: conditional
        "class K:\n"
        "    import msgspec\n"  # class bodies run at import time
        "def f():\n"
        "    import function_level_only\n"  # not at import time
        "    return function_level_only\n"
        "g = lambda: __import__('lambda_only')\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "helper.py").write_text("import zmq\nfrom ..core2 import missing_thing\nthing = 1\n")
    (pkg / "unused.py").write_text("import never_reached\n")
    # a wheel whose top_level.txt maps `zmq` to pyzmq
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", "w") as zf:
        zf.writestr("zmq/__init__.py", "")
        zf.writestr("pyzmq-27.3.0.dist-info/top_level.txt", "zmq\n")
    return tree, wheels


def test_scan_finds_module_level_imports_and_ignores_function_level(tiny_pkg):
    tree, wheels = tiny_pkg
    result = gi.scan([tree], ["tinypkg"])
    ext = result["externals"]
    assert {"numpy", "yaml", "zmq", "msgspec"} <= set(ext)
    assert ext["yaml"]["kind"] == ext["zmq"]["kind"] == ext["msgspec"]["kind"] == "needed"
    assert ext["fancy_optional"]["kind"] == "optional"
    assert ext["gpu_only_lib"]["kind"] == "conditional" and ext["gpu_only_lib"]["guards"] == ["if USE_GPU"]
    for absent in ("function_level_only", "lambda_only", "mypy_only", "never_reached", "os", "typing"):
        assert absent not in ext, absent
    assert "tinypkg.unused" not in result["reached"] and "tinypkg.sub.helper" in result["reached"]
    assert ext["zmq"]["chain"] == ["tinypkg", "tinypkg.core", "tinypkg.sub.helper"]
    # the relative `from ..core2 import` resolves to tinypkg.core2, which the tree lacks
    assert result["missing"]["tinypkg.core2"]["chain"][-1] == "tinypkg.sub.helper"


def test_scan_maps_names_to_distributions_and_subtracts_the_image(tiny_pkg):
    tree, wheels = tiny_pkg
    result = gi.map_externals(gi.scan([tree], ["tinypkg"]), {"numpy", "pyyaml"}, wheels, use_env=False)
    ext = result["externals"]
    assert (ext["zmq"]["dist"], ext["zmq"]["mapped_by"]) == ("pyzmq", "wheel")
    assert (ext["yaml"]["dist"], ext["yaml"]["mapped_by"]) == ("pyyaml", "table")
    assert ext["yaml"]["in_image"] and ext["numpy"]["in_image"] and not ext["zmq"]["in_image"]
    assert (ext["msgspec"]["dist"], ext["msgspec"]["in_image"]) == ("msgspec", False)


def test_scan_cli_fails_on_what_the_image_lacks(tiny_pkg, tmp_path):
    tree, wheels = tiny_pkg
    image = tmp_path / "image.txt"
    image.write_text("numpy\npyyaml\n")
    base = [
        sys.executable,
        str(SCRIPT),
        "scan",
        "--tree",
        str(tree),
        "--root",
        "tinypkg",
        "--wheels",
        str(wheels),
    ]
    out = tmp_path / "scan.json"
    proc = subprocess.run(
        [*base, "--image", str(image), "--json", str(out), "--fail-on-needed"], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    assert json.loads(out.read_text())["needed_dists"] == ["msgspec", "pyzmq"]
    assert "needed but not provided: ['msgspec', 'pyzmq']" in proc.stderr


def test_drop_deletes_matching_files_and_reports_them(tmp_path):
    tree = tmp_path / "t"
    (tree / "v" / "third" / "dg").mkdir(parents=True)
    (tree / "v" / "fa2.so").write_bytes(b"x" * 10)
    (tree / "v" / "fa3.so").write_bytes(b"y" * 5)
    (tree / "v" / "third" / "dg" / "a.h").write_bytes(b"z")
    dropped = gb.drop(tree, ["v/fa2.so", "v/third/dg/*"])
    assert [d["path"] for d in dropped] == ["v/fa2.so", "v/third/dg/a.h"] and dropped[0]["bytes"] == 10
    assert (tree / "v" / "fa3.so").exists() and not (tree / "v" / "third").exists()


def test_unwheel_lays_out_purelib_and_platlib_like_an_installer(tmp_path):
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("demo/__init__.py", "v = 1\n")
        zf.writestr("demo-1.0.data/platlib/demo_ext.py", "e = 1\n")
        zf.writestr("demo-1.0.data/scripts/demo-cli", "#!python\n")
        zf.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
    rows = gb.unwheel([whl], tmp_path / "site")
    assert rows == [{"dist": "demo", "version": "1.0", "wheel": whl.name}]
    assert sorted(_tree(tmp_path / "site")) == [
        "demo-1.0.dist-info/METADATA",
        "demo/__init__.py",
        "demo_ext.py",
    ]


def _fake_wheel(folder: Path, dist: str, version: str, files: dict[str, str]) -> Path:
    whl = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(
            f"{dist.replace('-', '_')}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n"
        )
    return whl


def test_build_resolved_carries_the_closure_less_the_image_and_the_other_bundle(tmp_path, capsys):
    """``build --resolved`` (the run bundle): every wheel pip resolved, except the image's and those
    the vLLM bundle's manifest lists; the drop list applies; the manifest says what was left out."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(
        wheels, "prefect", "3.7.7", {"prefect/__init__.py": "x = 1\n", "prefect/server/ui/app.js": "js"}
    )
    _fake_wheel(wheels, "sqlalchemy", "2.0.1", {"sqlalchemy/__init__.py": ""})
    _fake_wheel(wheels, "pydantic", "2.14.3", {"pydantic/__init__.py": ""})  # the vLLM bundle has it
    _fake_wheel(wheels, "numpy", "2.3.0", {"numpy/__init__.py": ""})  # the image has it
    reqs = tmp_path / "req.txt"
    reqs.write_text("prefect==3.7.7  # the flow\n")
    drop_list = tmp_path / "drop.txt"
    drop_list.write_text("prefect/server/ui/*\n")
    vllm_manifest = tmp_path / "vllm-manifest.json"
    vllm_manifest.write_text(json.dumps({"format": "qerl-gpu-bundle/1", "dependencies": [
        {"dist": "pydantic", "version": "2.14.3"}, {"dist": "vllm", "version": "0.26.0"}]}))  # fmt: skip
    args = ["build", "--resolved", "--provided", str(vllm_manifest), "--wheels", str(wheels),
            "--requirements", str(reqs), "--drop", str(drop_list), "--stage", str(tmp_path / "stage"),
            "--out", str(tmp_path / "out"), "--preset", "1"]  # fmt: skip
    assert gb.main(args) == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert sorted(d["dist"] for d in m["dependencies"]) == ["prefect", "sqlalchemy"]
    assert m["left_out"] == {"image": ["numpy==2.3.0"], "other bundles": ["pydantic==2.14.3"]}
    assert m["resolved_from"] == ["prefect==3.7.7"] and "scan" not in m and m["carry_dir"] == "out"
    assert [f["path"] for f in m["dropped"]["files"]] == ["prefect/server/ui/app.js"]
    # a version the other bundle provides differently, or a second version of a dist, is refused
    _fake_wheel(wheels, "pydantic", "2.12.0", {"pydantic/__init__.py": ""})
    with pytest.raises(SystemExit, match="several versions"):
        gb.main(args)
    (wheels / "pydantic-2.14.3-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit, match=r"pydantic 2\.12\.0 \(the other bundle has 2\.14\.3\)"):
        gb.main(args)


# -- the committed lists ----------------------------------------------------------------------------


def test_requirements_are_exact_pins_consistent_with_the_small_wheel_set():
    reqs = gb.parse_requirements(SCRIPTS / "gpu_vllm_requirements.txt")
    pins = {r["dist"]: r["version"] for r in reqs}
    assert pins["vllm"] == "0.26.0" and all(r["reason"] for r in reqs), "each line says why"
    image = gi.image_packages()
    assert not set(pins) & image, "carrying an image package would shadow the image's (torch above all)"
    small = (SCRIPTS / "fetch_gpu_wheels.sh").read_text()
    for dist in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection"):
        m = re.search(rf"(?<![-\w]){re.escape(dist)}==([\w.]+)", small)
        assert m and m.group(1) == pins[dist], f"{dist}: both bundles may share one sys.path"


def test_the_gpu_install_and_the_kit_pin_the_same_vllm_and_torch():
    from tests.gpu.test_gpu_install import GPU_REQS, pins

    install = pins(GPU_REQS)
    bundle = pins(SCRIPTS / "gpu_vllm_requirements.txt")  # the vLLM the kit carries
    image = pins(SCRIPTS / "gpu_replica_requirements.txt")  # the GPU image's torch, which the kit runs on
    assert install["vllm"] == bundle["vllm"], (install["vllm"], bundle["vllm"])
    for dist in ("torch", "torchvision", "torchaudio", "triton", "transformers"):
        assert install[dist] == image[dist], (dist, install[dist], image[dist])
    # the bundle's header says which torch its vLLM pins: the same
    header = (SCRIPTS / "gpu_vllm_requirements.txt").read_text()
    assert f"torch=={install['torch']}" in header
    # pins the bundle and the install share are the same versions (pydantic: both on one sys.path)
    for dist in set(install) & set(bundle):
        assert install[dist] == bundle[dist], (dist, install[dist], bundle[dist])


def test_the_image_list_reads_names_and_skips_comments(tmp_path):
    listing = tmp_path / "image.txt"
    listing.write_text(
        "# the image's packages, read today\ntorch Typing_Extensions  # pinned\n\nvllm-flash\n"
    )
    assert gi.image_packages(listing) == {"torch", "typing-extensions", "vllm-flash"}
    committed = gi.image_packages()
    assert {"torch", "triton", "transformers", "peft"} <= committed
    assert not {"the", "gpu", "image's"} & committed, "a comment's words are not distributions"


def test_run_bundle_pins_are_the_cpu_environments():
    """The run bundle carries what the CPU environment runs: the same Prefect, MLflow, math-verify and
    bitsandbytes."""
    cpu = {}
    for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if "==" in spec:
            name, version = spec.split("==", 1)
            cpu[gi.norm(name.split("[")[0])] = version.strip()
    reqs = gb.parse_requirements(SCRIPTS / "gpu_run_requirements.txt")
    assert {r["dist"] for r in reqs} == {"prefect", "mlflow", "math-verify", "bitsandbytes"} and all(
        r["reason"] for r in reqs
    )
    for r in reqs:
        assert cpu.get(r["dist"]) == r["version"], (r, cpu.get(r["dist"]))


def test_drop_list_spares_the_extensions_the_dense_path_loads():
    patterns = gb.read_list(SCRIPTS / "gpu_vllm_drop.txt")
    import fnmatch

    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in patterns
    for kept in ("vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/_qutlass_C.abi3.so",
                 "vllm/vllm_flash_attn/flash_attn_interface.py", "vllm/cumem_allocator.abi3.so"):  # fmt: skip
        assert not any(fnmatch.fnmatchcase(kept, p) for p in patterns), kept
    roots = gb.read_list(SCRIPTS / "gpu_vllm_roots.txt")
    assert "vllm.entrypoints.llm" in roots and "vllm.model_executor.models.qwen2" in roots


def test_the_shell_script_exposes_the_vllm_build():
    text = (SCRIPTS / "fetch_gpu_wheels.sh").read_text()
    assert "--vllm)" in text and "gpu_bundle.py build" in text
    check = (SCRIPTS / "gpu_offline.sh").read_text()
    assert "--stage-only)" in check and 'gpu_bundle.py" stage' in check and 'gpu_bundle.py" unpack' in check


def test_the_qerl_side_of_the_vllm_part_needs_only_the_image_and_the_bundle(tmp_path):
    """The static scan over our own code: what the vLLM kit (VLLM_KIT) imports from qerl, the vLLM
    engine and its worker extension (vLLM imports it by name in the worker), at module level, needs
    no distribution beyond the GPU image's and the bundle's (no Prefect, MLflow, math_verify...)."""
    import ast

    src = tmp_path / "src" / "qerl"
    src.mkdir(parents=True)
    (src / "__init__.py").write_bytes((ROOT / "qerl" / "__init__.py").read_bytes())
    for sub in ("pipeline", "stages", "kernels", "flows"):
        (src / sub).symlink_to(ROOT / sub)
    from tests.gpu.test_gpu import VLLM_KIT

    trees = [ast.parse((ROOT / f).read_text()) for f in VLLM_KIT]
    roots = sorted(
        {
            n.module
            for tree in trees
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("qerl.")
        }
    )
    roots += ["qerl.pipeline.rollout.vllm_engine", "qerl.pipeline.rollout.aqn_vllm"]
    result = gi.map_externals(gi.scan([src.parent], roots), set(), None, use_env=True)
    assert not result["missing"], result["missing"]
    assert len(result["reached"]) > 20
    provided = gi.image_packages()
    provided |= {r["dist"] for r in gb.parse_requirements(SCRIPTS / "gpu_vllm_requirements.txt")}
    needed = {
        top: (e["dist"], " > ".join(e["chain"]))
        for top, e in result["externals"].items()
        if e["kind"] == "needed" and e["dist"] not in provided
    }
    assert not needed, needed


LAZY_MODULE = '''"""A vLLM-style module: optional packages bound lazily."""
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.utils.import_utils import LazyLoader

if TYPE_CHECKING:
    import llguidance
else:
    llguidance = LazyLoader("llguidance", globals(), "llguidance")
    xgr = LazyLoader("xgr", globals(), "xgrammar")
    oc = LazyLoader("oc", globals(), "outlines_core")


@dataclass
class Grammar:
    matcher: llguidance.LLMatcher  # evaluated when the class is defined (Python 3.12)

    def fill(self, n: int) -> None:
        return oc.fill(n)  # a function body: runs when called


def compile_all(grammar: xgr.Grammar) -> None:  # a signature's annotation: evaluated at def time
    pass
'''


def test_lazy_modules_used_at_import_time_are_found_and_deferral_removes_them(tmp_path):
    """On an H200 ``import vllm.v1.structured_output`` failed with "No module named 'llguidance'": a
    class-body annotation names a LazyLoader-bound module, which Python evaluates at import. The scan
    now counts such uses as unguarded imports (function bodies and TYPE_CHECKING stay out), and
    ``from __future__ import annotations`` removes them where annotations are the only use."""
    import ast

    import gpu_lazy

    pkg = tmp_path / "tree" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    mod = pkg / "backend.py"
    mod.write_text(LAZY_MODULE)
    assert gpu_lazy.eager_lazy_modules(ast.parse(LAZY_MODULE)) == {"llguidance": True, "xgrammar": True}
    imported = {base for base, _, guard in gi.module_imports(mod, "vllm.backend", False) if not guard}
    assert {"llguidance", "xgrammar"} <= imported and "outlines_core" not in imported
    real_use = LAZY_MODULE + "\nDEFAULT = xgr.Grammar.builtin()\n"  # evaluated, not an annotation
    assert gpu_lazy.eager_lazy_modules(ast.parse(real_use)) == {"llguidance": True, "xgrammar": False}

    assert gpu_lazy.defer_annotations(mod) and not gpu_lazy.defer_annotations(mod)
    text = mod.read_text()
    assert text.splitlines()[1].startswith("from __future__ import annotations")  # after the docstring
    assert gpu_lazy.eager_lazy_modules(ast.parse(text)) == {}
    assert "llguidance" not in {b for b, _, g in gi.module_imports(mod, "vllm.backend", False) if not g}

    listing = tmp_path / "defer.txt"
    (pkg / "other.py").write_text(real_use)
    for rel, says in [
        ("vllm/absent.py", "not in the staged tree"),
        ("vllm/backend.py", "already defers"),
        ("vllm/other.py", "beyond annotations"),
    ]:
        listing.write_text(f"# comment\n{rel}  # why\n")
        with pytest.raises(SystemExit, match=says):
            gb._defer_checked(tmp_path / "tree", listing)
    fresh = tmp_path / "tree2" / "vllm"
    fresh.mkdir(parents=True)
    (fresh / "backend.py").write_text(LAZY_MODULE)
    listing.write_text("vllm/backend.py\n")
    assert gb._defer_checked(tmp_path / "tree2", listing) == ["vllm/backend.py"]
    compile((fresh / "backend.py").read_text(), "backend.py", "exec")  # still valid Python


def test_the_defer_list_names_only_what_the_vllm_wheel_needs_deferred():
    """Each listed module exists in the vLLM wheel (when it is here) and uses lazy modules only in
    annotations; the build applies the list before its scan, which then must find the tree closed."""
    import ast

    import gpu_lazy

    listed = gb.read_list(SCRIPTS / "gpu_vllm_defer_annotations.txt")
    assert listed and all(p.startswith("vllm/") and p.endswith(".py") for p in listed)
    wheels = sorted((ROOT / ".gpu-vllm-build" / "wheels").glob("vllm-*.whl"))
    if not wheels:
        pytest.skip("no vLLM wheel here (tools/gpu_transfer/fetch_gpu_wheels.sh --vllm downloads it)")
    with zipfile.ZipFile(wheels[-1]) as zf:
        for rel in listed:
            uses = gpu_lazy.eager_lazy_modules(ast.parse(zf.read(rel)))
            assert uses and all(uses.values()), (rel, uses)


def test_the_kit_turns_off_the_sampler_that_needs_flashinfer():
    """The bundle leaves FlashInfer out; vLLM's sampler imports it at engine start unless
    VLLM_USE_FLASHINFER_SAMPLER=0 (the engine failed to start on an H200 without it). gpu_offline.sh
    sets it, and the vLLM wheel (when it is here) still reads that switch before the import."""
    assert (
        "export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}"
        in (SCRIPTS / "gpu_offline.sh").read_text()
    )
    wheels = sorted((ROOT / ".gpu-vllm-build" / "wheels").glob("vllm-*.whl"))
    if not wheels:
        pytest.skip("no vLLM wheel here (tools/gpu_transfer/fetch_gpu_wheels.sh --vllm downloads it)")
    with zipfile.ZipFile(wheels[-1]) as zf:
        src = zf.read("vllm/v1/sample/ops/topk_topp_sampler.py").decode()
    switch, needs = (
        src.find("if not envs.VLLM_USE_FLASHINFER_SAMPLER:"),
        src.find("backends.flashinfer import"),
    )
    assert 0 < switch < needs, "vLLM's sampler no longer checks the switch before importing FlashInfer"


def test_the_root_import_check_names_every_failing_root(tmp_path):
    """After extracting the bundle gpu_offline.sh imports each root of the scan on its own
    (tools/gpu_transfer/gpu_import_roots.py), so one call shows every module the scan missed (on the first H200
    run each missing module cost a try)."""
    pkg = tmp_path / "site" / "fake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("import json\n")
    (pkg / "absent.py").write_text("import not_a_real_package_xyz\n")
    (pkg / "annotated.py").write_text("class A:\n    x: undefined_name.Thing\n")
    roots = tmp_path / "roots.txt"
    roots.write_text("# roots\nfake.good\nfake.absent  # needs a package\nfake.annotated\nfake.nothing\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_import_roots.py"), str(roots)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("imports: 1 of 4 roots import")
    assert lines[1:] == [
        "  fake.absent: ModuleNotFoundError: No module named 'not_a_real_package_xyz'",
        "  fake.annotated: NameError: name 'undefined_name' is not defined",
        "  fake.nothing: ModuleNotFoundError: No module named 'fake.nothing'",
    ]
    roots.write_text("fake.good\n")
    ok = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_import_roots.py"), str(roots)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.startswith("imports: 1 of 1 roots import")


def test_the_kits_src_folder_puts_qerl_first_and_the_bundles_after_site_packages(tmp_path):
    """tools/gpu_transfer/gpu_src.sh: qerl imports from the folder, and in every process started with it (a
    child of a child too: vLLM's engine core, `qerl run`) the bundles come after site-packages."""
    subprocess.run(["bash", str(SCRIPTS / "gpu_src.sh"), str(tmp_path / "src")], check=True)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "from_the_bundle.py").write_text("X = 1\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src"), "QERL_SYS_PATH_AFTER": str(bundle)}
    code = (
        "import json, site, sys, qerl.pipeline, from_the_bundle; "
        "print(json.dumps([qerl.__file__, sys.path.index(sys.argv[1]), "
        "max(sys.path.index(p) for p in site.getsitepackages() if p in sys.path)]))"
    )
    child = (
        f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}, sys.argv[1]], check=True)"
    )
    out = subprocess.run(  # not from the checkout, whose own qerl/ `-c` would put first
        [sys.executable, "-c", child, str(bundle)], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    qerl_file, bundle_at, site_at = json.loads(out.stdout)
    assert qerl_file.startswith(str(tmp_path / "src"))
    assert bundle_at > site_at


def test_wheel_script_downloads_and_enforces_the_limit(tmp_path):
    """One tiny wheel (iniconfig, ~8 KB) from the registry, then the same with a limit it exceeds."""
    script = SCRIPTS / "fetch_gpu_wheels.sh"
    proc = subprocess.run(
        ["bash", str(script), "--dest", str(tmp_path / "w"), "--only", "iniconfig"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 and re.search(r"(?i)connection|resolve|network|temporary failure", proc.stderr):
        pytest.skip(f"package registry unreachable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = list((tmp_path / "w").glob("iniconfig-*-py3-none-any.whl"))
    assert len(wheels) == 1
    manifest = json.loads((tmp_path / "w" / "wheels.json").read_text())
    assert manifest["total_bytes"] == wheels[0].stat().st_size and manifest["python"] == "3.12"
    over = subprocess.run(
        ["bash", str(script), "--dest", str(tmp_path / "w2"), "--only", "iniconfig", "--max-mib", "0.001"],
        capture_output=True,
        text=True,
    )
    assert over.returncode != 0 and "over the 0.001 MiB limit" in over.stderr
