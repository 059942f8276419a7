"""Prefect (and Ray) only: the flows that run stages, and the command line that starts them.

- the RL flow: ``rl`` (``rl_flow``), its tasks (``rl_tasks``), its phases (``rl_phases``) and the run
  record (``run_record``);
- ablations: ``ablate`` (one run per arm and seed, then the comparison) and ``ray`` (the same runs
  fanned out over a Ray cluster);
- the console of a run (``console``), the nightly deployment and Prefect settings (``runner``) and the
  ``qerl`` command (``cli`` and the command modules it dispatches to).

May import ``qerl.stages`` and ``qerl.pipeline``; nothing in ``pipeline``, ``stages`` or ``kernels`` imports
Prefect or Ray.
"""
