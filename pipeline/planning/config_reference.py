"""The configuration reference, generated from the config classes so it cannot drift from the code.

Every leaf setting of ``RunConfig`` becomes one row (key, type, default, whether cache keys and the
run id hold it, the field's description), in declaration order. A setting is out of the keys when it
or a section above it is a resource field (``qerl.pipeline.config.resource_field``). The rows are rendered into the docs site's page ``docs/reference/configuration.md``;
a test checks that the committed page equals what this module generates.

``python -m qerl.pipeline.planning.config_reference`` rewrites that page in the repository;
``... config_reference PATH`` writes PATH instead, and ``... config_reference -`` prints the page.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from qerl.pipeline.config import StrictModel, is_resource
from qerl.pipeline.planning.run_config import RunConfig

REGENERATE = "python -m qerl.pipeline.planning.config_reference"
# The repository's docs page (pipeline/planning/ -> the repository root when run from a checkout)
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "configuration.md"

_INTRO = """\
# Configuration reference

<!-- generated from the config classes by `{regenerate}`; do not edit by hand -->

Every setting of a run, generated from the config classes (a test keeps this page in sync with the
code). Keys are `section.key`, as in a YAML config or a `--set section.key=value` override; the
default is the value in JSON. "in keys" says whether the setting changes results: a "yes" setting
is part of the cache keys of the stages that read it and of the run id, so changing it computes anew;
a "no" setting changes only resources (memory, batching, processes, deadlines, what retention
deletes): the manifests and the run record keep it, and a run resumed with another value reuses every
step it finished. How to write a config, the presets and the settings derived at load
time are on the [configuration](../configuration.md) page.

"""


def _type_name(annotation: object) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


def reference_rows(
    model: type[StrictModel] = RunConfig, prefix: str = "", keyed: bool = True
) -> list[tuple[str, str, str, bool, str]]:
    """(key, type, default, in keys, description) for every leaf setting, in declaration order."""
    rows: list[tuple[str, str, str, bool, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        in_keys = keyed and not is_resource(field)
        if isinstance(annotation, type) and issubclass(annotation, StrictModel):
            rows.extend(reference_rows(annotation, f"{key}.", in_keys))
            continue
        default = field.get_default(call_default_factory=True)
        default_text = json.dumps(
            default.model_dump(mode="json") if hasattr(default, "model_dump") else default
        )
        description = (field.description or "").replace("|", "/")
        rows.append((key, _type_name(annotation), default_text, in_keys, description))
    return rows


def _html_text(text: str) -> str:
    """A description as markdown text: ``<work>/x`` is shown, not taken for an HTML tag."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def reference_markdown() -> str:
    """The reference table: one row per leaf setting."""
    lines = ["| key | type | default | in keys | meaning |", "|---|---|---|---|---|"]
    lines += [
        f"| `{k}` | `{t}` | `{d}` | {'yes' if keyed else 'no'} | {_html_text(m)} |"
        for k, t, d, keyed, m in reference_rows()
    ]
    return "\n".join(lines) + "\n"


def reference_page() -> str:
    """The whole docs page ``docs/reference/configuration.md``: a short introduction, then the table."""
    return _INTRO.format(regenerate=REGENERATE) + reference_markdown()


def write_page(path: Path = DOCS_PAGE) -> None:
    """Write the page (a temporary file renamed into place, so a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(reference_page())
    os.replace(tmp, path)


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else None
    if target == "-":
        print(reference_page(), end="")
    else:
        write_page(Path(target) if target else DOCS_PAGE)
