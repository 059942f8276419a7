"""The registry's commands: ``qerl versions`` lists a model's versions, ``qerl promote`` moves the
champion, ``qerl policy`` shows or changes a model's promotion policy (``qerl.pipeline.registry.policy``).

``qerl versions`` is what an operator on a machine without a browser asks first: which version is
champion and challenger, which night made each, what it scored on the test benchmark and on the
validation split promotion decides on, and which were released by retention (``store.keep_versions``)
and so have no adapter left.

Neither command creates anything (``adapters.open_registry``): a work directory without a registry, or
a model name the registry does not hold, is an error naming the registry and the models it holds, so
a mistyped ``--work-dir`` or name cannot leave an empty database or an empty registered model behind.
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket

import yaml
from mlflow.tracking import MlflowClient
from qerl.pipeline.config import load_config
from qerl.pipeline.registry import adapters, health, heldout, policy, promotion
from qerl.pipeline.registry.lock import RegistryError, registry_lock
from qerl.pipeline.registry.release import RELEASED_TAG, check_not_released
from qerl.pipeline.registry.tracking import RegistryConfig
from qerl.pipeline.store.layout import default_work_dir


def registry_config(args: argparse.Namespace) -> RegistryConfig:
    """The commands' registry settings: ``--config``, then ``--set KEY=VALUE``, where a run config's
    spelling (``registry.tracking_uri=...``, as ``qerl run`` and ``qerl eval`` take it) means the same."""
    sets = [s.removeprefix("registry.") for s in args.set]
    return load_config(RegistryConfig, args.config, sets, prefix="registry" if sets != args.set else "")


def cmd_promote(args: argparse.Namespace) -> int:
    cfg = registry_config(args).model_copy(update={"model_name": args.name})
    # promoting creates nothing: a typo is an error
    uri = adapters.open_registry(cfg, default_work_dir(args.work_dir))
    adapters.require_registered_model(args.name, uri)
    version = adapters.registered_version(args.name, args.version)
    if version is not None:  # None: promote says the version does not exist
        check_not_released(version)
    promotion.promote(cfg, args.name, args.version)
    info = promotion.version_info(cfg, args.version)
    if RELEASED_TAG in info["tags"]:  # released between the check and the lock: say so, loudly
        raise RegistryError(
            f"{args.name} v{args.version} was released by retention while being promoted: "
            f"@{cfg.champion_alias} now names a version without an adapter; promote another"
        )
    print(f"{args.name} v{args.version} is now @{cfg.champion_alias} (aliases: {', '.join(info['aliases'])})")
    return 0


def cmd_heldout(args: argparse.Namespace) -> int:
    """``qerl heldout``: restore a lineage's held-out status by hand (``qerl.pipeline.registry.heldout``)."""
    cfg = registry_config(args).model_copy(update={"model_name": args.name})
    uri = adapters.open_registry(cfg, default_work_dir(args.work_dir))
    adapters.require_registered_model(args.name, uri)
    if adapters.registered_version(args.name, args.version) is None:
        raise RegistryError(f"model version {args.name} v{args.version} does not exist")
    by = f"qerl heldout by {getpass.getuser()}@{socket.gethostname()}"
    with registry_lock(uri, args.name, cfg.lock_timeout_s):
        record = heldout.attest_heldout(args.name, args.version, args.reason, by, args.items)
    was = record["was"] or "no tag"
    print(
        f"{args.name} v{args.version}: held-out items {record['items'][:12]} (was {was[:12]}), attested {by}"
    )
    return 0


def _accuracy(tags: dict[str, str], key: str) -> str:
    try:
        return f"{float(tags[key]):.3f}"
    except (KeyError, ValueError):
        return "-"


def cmd_versions(args: argparse.Namespace) -> int:
    cfg = registry_config(args)
    name = args.name or cfg.model_name
    uri = adapters.open_registry(cfg, default_work_dir(args.work_dir))
    adapters.require_registered_model(name, uri)
    client = MlflowClient()
    versions = sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: -int(v.version))
    if not versions:
        print(f"{name} in {health.shown_uri(uri)}: no versions")
        return 0
    aliases: dict[str, list[str]] = {}
    for alias, number in client.get_registered_model(name).aliases.items():
        aliases.setdefault(str(number), []).append(alias)
    count = f"{len(versions)} version{'' if len(versions) == 1 else 's'}"
    print(f"{name} in {health.shown_uri(uri)}: {count} (test / validation accuracy)")
    for v in versions:
        tags = dict(v.tags)
        held = ", ".join(f"@{a}" for a in sorted(aliases.get(str(v.version), []))) or "-"
        released = tags.get(RELEASED_TAG)
        state = f"released {released.split(',')[0]}" if released else "kept"
        if tags.get("complete") == "false":
            state += ", incomplete run"
        test, validation = _accuracy(tags, "eval_accuracy"), _accuracy(tags, "promotion_accuracy")
        print(f"  v{v.version:<4} {held:<24} {tags.get('run_id', '-'):<32} {test} / {validation}  {state}")
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    cfg = registry_config(args)
    name = args.name or cfg.model_name
    uri = adapters.open_registry(cfg, default_work_dir(args.work_dir))
    adapters.require_registered_model(name, uri)
    if args.change:
        updates = {}
        for item in args.change:
            key, sep, value = item.partition("=")
            if not sep:
                raise RegistryError(
                    f"--change {item!r} is not KEY=VALUE (keys: {', '.join(policy.CHANGEABLE)})"
                )
            key, fields = key.strip(), policy.PromotionPolicy.model_fields
            # a text field as typed: YAML would read an all-digit digest as a number
            text = key in fields and fields[key].annotation is str
            updates[key] = value.strip() if text else yaml.safe_load(value)
        with registry_lock(uri, name, cfg.lock_timeout_s):
            policy.change_policy(name, updates, f"qerl policy by {getpass.getuser()}")
    current = policy.read_policy(name)
    if current is None:
        print(f"{name}: no promotion policy yet (its first complete run with a validation split sets it)")
        return 0
    print(f"{name}: promotion policy (set by {current.set_by})")
    for key, value in current.model_dump().items():
        if key != "set_by":
            print(f"  {key:<13} {value}")
    for change in policy.policy_changes(name):
        print(
            f"  changed {change['at']} by {change['by']}: {json.dumps(change['from'])} -> {json.dumps(change['to'])}"
        )
    return 0
