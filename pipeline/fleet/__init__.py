"""A team's fleet: what lets several GPU machines share one nightly line.

- ``settings``: where the fleet's services are (the coordination database from ``QERL_FLEET_DB``,
  the credentials file of ``QERL_CREDENTIALS_FILE``, this machine's GPU id) and how a URL is shown
  without its password;
- ``coordination``: PostgreSQL advisory locks and rows: run leases, build exclusion, the registry's
  critical section and the data cursor, seen by every machine;
- ``gpu_lock``: the host-local lock a run takes on its GPU.

Imports only ``qerl.pipeline.config`` and ``qerl.pipeline.runtime`` from the project, so the store,
the planning and the registry packages may all import it.
"""
