"""The MLflow layer: tracking of runs, the model registry and its locks.

- ``lock``: one exclusive lock per registered model, whatever the backend (sqlite flock, PostgreSQL
  advisory lock, a ticket lock on a tracking server);
- ``tracking``: ``RegistryConfig``, the connection (``connect``), each run's metrics, params, plots;
- ``health``: the registry asked once before a run (``check_reachable``), MLflow's HTTP retries bounded;
- ``promotion``: adapter versions with lineage, the challenger/champion aliases and the promotion rule.
- ``adapters``: a registered version read back (by number, alias or ``models:/`` URI), checked against
  the base and fetched into the store (the nightly warm start, ``qerl eval``).

Imports ``qerl.pipeline.config`` and ``qerl.pipeline.store`` (layout names, file digests) from the project, never
``planning``, ``rl`` or ``rollout``; ``planning`` (the warm start) and the stages import it.
"""
