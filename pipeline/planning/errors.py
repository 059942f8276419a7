"""The error a run's planning raises: the run cannot start (or go on) as configured.

Raised where a plan is decided (no prompt fits, an unusable champion, a night that is not a date)
and by the flow for the same kind of problem; the CLI prints it as a one-line error (a ValueError).
"""

from __future__ import annotations


class RunPlanError(ValueError):
    """A run cannot be planned as configured (no prompt fits, an unusable champion, a bad night)."""
