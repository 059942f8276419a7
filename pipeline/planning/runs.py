"""What makes a run the same run: its id, the settings a resume may change, and its recorded config.

A plain run's id is ``<loop.name>-<config hash>``, the hash of the settings that change results
(resource settings, the retention policy ``store`` among them, are not part of it:
``qerl.pipeline.config.resource_field``); a nightly run's id adds the night (``-YYYYMMDD``). So the
same config is the same run, and every night is a new one. ``with_resources`` applies ``qerl resume
RUN --set``: resource settings only, since any other setting would make another run. The record
itself is ``qerl.pipeline.store.run_record``.
"""

from __future__ import annotations

import datetime as _dt

from qerl.pipeline.config import ConfigError, apply_overrides, config_hash
from qerl.pipeline.planning.prompt_stream import night_label
from qerl.pipeline.planning.run_config import RunConfig
from qerl.pipeline.store.run_record import RecordError, RunRecord


def run_id_for(cfg: RunConfig, night: _dt.date | None = None) -> str:
    """``<loop.name>-<config hash>``, plus ``-YYYYMMDD`` for a nightly run."""
    base = f"{cfg.loop.name}-{config_hash(cfg)[:10]}"
    return f"{base}-{night_label(night)}" if night else base


def recorded_config(record: RunRecord) -> RunConfig:
    """The config a recorded run ran with (what ``qerl resume`` runs again)."""
    try:
        return RunConfig.model_validate(record.config)
    except ValueError as err:
        raise RecordError(f"run {record.run_id}: its recorded config is not valid today ({err})") from None


def with_resources(cfg: RunConfig, night: _dt.date | None, overrides: list[str]) -> RunConfig:
    """A recorded run's config with ``--set`` overrides of resource settings (``qerl resume --set``);
    an override that changes results (the run id) is a ConfigError naming it."""
    run_id = run_id_for(cfg, night)
    # validated together: settings that only fit as a pair (a smaller minibatch with a larger
    # grad_accum keeps the update size) must not be checked one at a time
    combined = apply_overrides(cfg, overrides)
    if run_id_for(combined, night) == run_id:
        return combined
    blamed = [pair for pair in overrides if _changes_run(cfg, night, pair, run_id)] or overrides
    raise ConfigError(
        f"--set {', '.join(blamed)} changes results (the setting is in cache keys and the run id): that is "
        f"another run than {run_id}; start it with qerl run. resume --set takes resource settings "
        'only ("in keys: no" in the configuration reference)'
    )


def _changes_run(cfg: RunConfig, night: _dt.date | None, pair: str, run_id: str) -> bool:
    """Whether ``--set pair`` alone gives another run id (False when it is invalid alone)."""
    try:
        return run_id_for(apply_overrides(cfg, [pair]), night) != run_id
    except ConfigError:
        return False
