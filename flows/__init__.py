"""Prefect (and Ray) only: the flow that runs a night, and the command line that starts it.

- ``run``: one run, top to bottom (``rl_flow``: the one way a run starts; its phases in order; the
  ``Chain`` of its checkpoints); ``tasks``: a thin Prefect task over each stage; ``report``: the run's
  results for people and Prefect's artifacts; ``deadline``: an attempt past ``loop.deadline_h``;
- ``orchestration``: Prefect's environment, the API a run reports to, the nightly deployment;
- ``console``: lines for people, the libraries' chatter in a log file;
- ``ablate`` (one run per arm and seed, then the comparison) and ``ray`` (the same runs fanned out
  over a Ray cluster);
- ``cli`` (the parser and the dispatch) and the handlers it imports when a command runs:
  ``commands`` (run, resume, schedule, ablate, runs), ``tool_commands``, ``registry_commands``,
  ``store_commands``.

The run's record is typed and lives below, in ``qerl.pipeline.store.run_record``, with the run's id
(``qerl.pipeline.planning.runs``). May import ``qerl.stages`` and ``qerl.pipeline``; nothing in
``pipeline``, ``stages`` or ``kernels`` imports Prefect or Ray.
"""
