"""Config machinery: YAML then --set overrides, unknown keys rejected with the valid ones listed."""

from __future__ import annotations

import pytest

from pipeline.config import (
    ConfigError,
    StrictModel,
    apply_overrides,
    config_hash,
    load_config,
    parse_overrides,
)


class Inner(StrictModel):
    lr: float = 1e-5
    targets: list[str] = ["q_proj"]


class Outer(StrictModel):
    name: str = "demo"
    steps: int = 4
    inner: Inner = Inner()


def test_defaults_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run1\ninner:\n  lr: 0.001\n")
    cfg = load_config(Outer, path, ["inner.targets=[a, b]", "steps=7"])
    assert cfg.name == "run1" and cfg.steps == 7
    assert cfg.inner.lr == 0.001 and cfg.inner.targets == ["a", "b"]


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"inner\.learning_rate.*valid keys here: lr, targets"):
        load_config(Outer, path)
    with pytest.raises(ConfigError, match="stepz.*inner, name, steps"):
        load_config(Outer, None, ["stepz=3"])


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match="steps"):
        load_config(Outer, None, ["steps=many"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["steps"])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Outer, tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Outer, bad)


def test_apply_overrides_and_hash_is_stable():
    cfg = Outer()
    changed = apply_overrides(cfg, ["inner.lr=0.5"])
    assert changed.inner.lr == 0.5 and cfg.inner.lr == 1e-5
    assert config_hash(cfg) == config_hash(Outer()) != config_hash(changed)


def test_configs_are_frozen():
    with pytest.raises(Exception, match="frozen"):
        Outer().steps = 3  # type: ignore[misc]
