"""Typed, validated configuration: one pydantic model per stage, defaults in one place.

Every config is a frozen pydantic model that rejects unknown keys. Loading goes YAML first, then
``--set section.key=value`` overrides (values parsed as YAML scalars, so ``3``, ``1e-5``, ``true``
and ``[a, b]`` mean what they look like). A misspelled key fails with the list of valid keys at that
level, which pydantic's own message does not give.

The per-stage models (QuantizeConfig, RolloutConfig, ...) live in the modules that own them and are
assembled into ``RunConfig`` by ``qerl.pipeline.planning.run_config``; this module holds only the machinery, so
that adding a stage never means editing a central file.

Results and resources: a field declared with ``resource_field`` changes only what a stage uses to get
its result (memory, batching, processes, deadlines), never which result it computes. Cache keys and
the run id hash ``key_payload``: the config without those fields (recursively, also inside dicts and
lists of configs), plus what a model's ``key_extra`` says its resource fields add up to (the train
update size). Manifests and run records keep the whole config (``config_record``), so a resumed run
may change its resources and still reuse every artifact it built.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = [
    "ConfigError",
    "StrictModel",
    "apply_overrides",
    "config_hash",
    "config_record",
    "is_resource",
    "key_payload",
    "load_config",
    "parse_overrides",
    "resource_field",
]

M = TypeVar("M", bound="StrictModel")


class ConfigError(ValueError):
    """A configuration problem, with a message that names the offending key and the valid ones."""


class StrictModel(BaseModel):
    """Base for all configs: unknown keys are errors, instances are immutable, floats are finite (an
    ``inf`` learning rate or a ``nan`` sigma is a typo, never a setting)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)

    def key_extra(self) -> dict[str, Any]:
        """What this config's resource fields add up to where it changes the result (see the module
        docstring); merged into ``key_payload``. Nothing by default."""
        return {}


_RESOURCE = "resource"


def resource_field(default: Any = PydanticUndefined, **kwargs: Any) -> Any:
    """``pydantic.Field`` for a setting that changes only the resources a stage uses, never its
    result: manifests record it, cache keys and the run id leave it out."""
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    return Field(default, json_schema_extra={**extra, _RESOURCE: True}, **kwargs)


def is_resource(field: FieldInfo) -> bool:
    """Whether ``field`` was declared with ``resource_field``."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(_RESOURCE))


def _strip(value: Any, dumped: Any) -> Any:
    """``dumped`` (the JSON dump of ``value``) without the resource fields of the models in it."""
    if isinstance(value, BaseModel) and isinstance(dumped, dict):
        out = dict(dumped)
        for name, field in type(value).model_fields.items():
            if is_resource(field):
                out.pop(name, None)
            elif name in out:
                out[name] = _strip(getattr(value, name), out[name])
        if isinstance(value, StrictModel):
            out.update(value.key_extra())
        return out
    if isinstance(value, list | tuple) and isinstance(dumped, list) and len(value) == len(dumped):
        return [_strip(v, d) for v, d in zip(value, dumped, strict=True)]
    if isinstance(value, dict) and isinstance(dumped, dict):
        return {k: _strip(value[k], d) if k in value else d for k, d in dumped.items()}
    return dumped


def key_payload(cfg: Any) -> Any:
    """The JSON of ``cfg`` (a config, or a dict/list holding configs) that a cache key or the run id
    hashes: without resource fields, with each model's ``key_extra``."""
    return _strip(cfg, config_record(cfg))


def config_record(cfg: Any) -> Any:
    """The whole JSON of ``cfg`` (configs dumped in full, resource fields included): what manifests
    and run records keep."""
    if isinstance(cfg, BaseModel):
        return cfg.model_dump(mode="json")
    if isinstance(cfg, dict):
        return {k: config_record(v) for k, v in cfg.items()}
    if isinstance(cfg, list | tuple):
        return [config_record(v) for v in cfg]
    return cfg


def _valid_keys(model: type[BaseModel]) -> list[str]:
    return sorted(model.model_fields)


def _check_keys(model: type[BaseModel], data: Any, where: str) -> None:
    """Walk ``data`` against ``model`` and raise on the first unknown key, listing the valid ones."""
    if not isinstance(data, dict):
        return
    valid = _valid_keys(model)
    for key, value in data.items():
        if key not in model.model_fields:
            path = f"{where}.{key}" if where else key
            raise ConfigError(f"unknown config key '{path}'; valid keys here: {', '.join(valid)}")
        annotation = model.model_fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _check_keys(annotation, value, f"{where}.{key}" if where else key)


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are YAML scalars."""
    nested: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ConfigError(f"override '{pair}' is not of the form section.key=value")
        dotted, raw = pair.split("=", 1)
        parts = [p for p in dotted.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"override '{pair}' has an empty key")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{pair}' sets a key below the scalar '{part}'")
        node[parts[-1]] = _yaml(raw, f"the value of override '{pair}'", at=False) if raw != "" else ""
    return nested


def _yaml(text: str, what: str, at: bool = True) -> Any:
    """``text`` parsed as YAML; a ``ConfigError`` naming ``what`` and, ``at``, where the parse stopped."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if at and mark is not None else ""
        raise ConfigError(
            f"{what} is not valid YAML{where}: {getattr(err, 'problem', None) or err}"
        ) from None


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_overrides(cfg: M, overrides: list[str] | dict[str, Any] | None, prefix: str = "") -> M:
    """Return a copy of ``cfg`` with dotted overrides applied and re-validated. ``prefix``: the section
    the user wrote them under (``rollout`` for ``--set rollout.x=1``), so errors name the full key."""
    extra = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    pairs = overrides if isinstance(overrides, list) else None
    merged = _deep_merge(cfg.model_dump(mode="json"), extra or {})
    return _validate(type(cfg), merged, "overrides", pairs, prefix)


def _blame(loc: tuple, overrides: list[str]) -> str | None:
    """The ``--set`` override that set the value at ``loc`` (or a section above it), if one did."""
    dotted = ".".join(str(p) for p in loc)
    for pair in reversed(overrides):
        key = pair.split("=", 1)[0].strip()
        if dotted == key or dotted.startswith(key + ".") or key.startswith(dotted + "."):
            return pair
    return None


def _cross_field_source(message: str, source: str, overrides: list[str] | None, lead: str) -> str:
    """Where a cross-field error's values came from: the ``--set`` overrides whose keys its message
    names; else the file (or defaults) and every override together."""
    keys = [o.partition("=")[0].strip() for o in overrides or []]
    named = [o for o, k in zip(overrides or [], keys, strict=True) if k and (lead + k) in message]
    if named:
        return f" (from --set {', --set '.join(lead + o for o in named)})"
    sets = f" with --set {', '.join(lead + o for o in overrides)}" if overrides else ""
    return f" (a check across settings: {source}{sets})"


def _validate(
    model: type[M], data: dict[str, Any], source: str, overrides: list[str] | None = None, prefix: str = ""
) -> M:
    """Validate ``data``; an error names each bad key (under ``prefix``, the section the overrides
    were written under) and where its value came from: the ``--set`` override that set it, else
    ``source`` (the YAML file, or the defaults)."""
    _check_keys(model, data, prefix)
    lead = f"{prefix}." if prefix else ""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            if not e["loc"]:  # a check across settings: blame the overrides it names, else all sources
                problems.append(
                    f"{prefix or 'config'}: {e['msg']}"
                    + _cross_field_source(e["msg"], source, overrides, lead)
                )
                continue
            where = _blame(e["loc"], overrides or [])
            key = lead + ".".join(str(p) for p in e["loc"])
            problems.append(
                f"{key}: {e['msg']}" + (f" (from --set {lead}{where})" if where else f" (from {source})")
            )
        raise ConfigError("invalid config: " + "; ".join(problems)) from None


def load_config(
    model: type[M], path: str | Path | None = None, overrides: list[str] | None = None, prefix: str = ""
) -> M:
    """Load ``model`` from an optional YAML file, then apply ``--set`` style overrides (written under
    ``prefix``, if given: errors then name ``prefix.key``)."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        loaded = _yaml(path.read_text(), f"config file {path}")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded
        source = str(path)
    data = _deep_merge(data, parse_overrides(overrides))
    return _validate(model, data, source, overrides, prefix)


def config_hash(cfg: BaseModel | dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a config's ``key_payload`` (sorted keys, resource fields left
    out): the config part of a cache key and of the run id."""
    payload = key_payload(cfg)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
