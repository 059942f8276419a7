"""Evaluation and ablations, without Prefect: what an evaluation measures (``eval_config``: the
benchmark, k and sampling), the statistics (``statistics``: avg@k, pass@k, standard errors, t
intervals, the paired bootstrap), an evaluation's per-item rates (``items``: what paired comparisons
read), the ablation arms (``arms``: config overrides, seeds, ids) and the
comparison of their runs with its report (``report``: curves, plots, markdown).

The evaluate stage is ``qerl.stages.evaluate``; the ablation flow ``qerl.flows.ablate``. May import
``config``, ``runtime``, ``store``, ``nvfp4`` and ``data``.
"""
