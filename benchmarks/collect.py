"""Assemble BENCHMARKS.md from the sections each benchmark wrote to benchmarks/results/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# gpu.md comes from bench_gpu.py on a CUDA machine only
ORDER = [
    "quantize",
    "quantize-quality",
    "gptq-shapes",
    "score",
    "rollout",
    "train",
    "contention",
    "contention-busy",
    "aqn-dtype",
    "shared-store",
    "fleet",
    "soak",
    "gpu",
]

HEADER = """# Benchmarks

Each section is written by `benchmarks/bench_<name>.py` (run one with `qerl bench NAME`, all with
`qerl bench`), measured side by side in one run on the same machine, and reported as ratios. The
machine is the project's CPU box (2 cores, 24 GiB) unless a section says otherwise.
"""


def assemble() -> str:
    """BENCHMARKS.md's text: the header, then each section of benchmarks/results/ in ORDER."""
    results = ROOT / "benchmarks" / "results"
    names = sorted(
        (p.stem for p in results.glob("*.md")),
        key=lambda n: (n not in ORDER, ORDER.index(n) if n in ORDER else 0, n),
    )
    return HEADER + "".join("\n" + (results / f"{n}.md").read_text().strip() + "\n" for n in names)


def main() -> str:
    text = assemble()
    from qerl.pipeline.store.files import atomic_write_text

    atomic_write_text(ROOT / "BENCHMARKS.md", text)
    return text


if __name__ == "__main__":
    main()
