"""An ablation's runs on a Ray cluster (``qerl ablate --ray ADDRESS``): what the driver checks, what a
worker gets, and how the runs come back.

Without an address ``qerl.flows.ablate`` runs its (arm, seed) runs one after the other in its own
process. With one (``--ray ADDRESS`` or ``$QERL_RAY_ADDRESS``; ``local`` starts a private Ray instance
on this machine) the ablation flow runs on prefect-ray's ``RayTaskRunner``: every run is one Prefect
task (``ablation-run``) submitted at once with the Ray resources it asks for (``prefect_ray``'s
``remote_options``: ``num_cpus`` per run, default 1; ``num_gpus`` per run, by default the rollout's
tensor-parallel size when the cluster has GPUs, else 0, so on a cluster with GPUs no run lands on a
CPU-only node and changes engine mode). In its Ray worker that task calls the same ``rl_flow`` as the
sequential path. The unit is unchanged: one ordinary run per (arm, seed) whose id is its config hash,
its stages cached in the shared store, so re-running a killed ablation resumes every run and rebuilds
nothing finished; two runs that need the same artifact (the NVFP4 base of two arms) serialise on the
store's lock and the second finds the first's result. The store and registry: the work dir goes to
each task as an absolute path and the MLflow tracking URI, resolved in the driver, is re-resolved in
the worker and must be identical.

- ``rules``: the address, work dir, registry and Prefect API a cluster allows (no Ray import);
- ``runtime_env``: what a worker gets from the driver (the ``qerl`` package, the environment);
- ``probe``: every node sees the work dir and runs the driver's package versions;
- ``connection``: check, connect, probe; the ``RayTaskRunner`` and the plan of the fan-out;
- ``runs``: the worker task of one (arm, seed) run and the driver's loop that collects them.

Prefect and Ray live here and in the rest of ``qerl.flows``; nothing below ``flows`` imports them.
"""
