"""Imported by the reward verifier's fork server: warm math-verify once so every forked worker starts hot.

The first ``parse``/``verify`` in a process pays for lazy imports inside latex2sympy and sympy and for
building the parsers. Doing it here, in the fork server, means a worker that replaces a killed one is
ready in milliseconds instead of paying that again for every timeout.
"""

from __future__ import annotations

import logging

from qerl.pipeline.data.rewards import verify_pair

logging.getLogger("math_verify").setLevel(logging.ERROR)
for _pred, _gold in (
    ("0.5", "\\frac{1}{2}"),
    ("x = 3", "3"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("1,2", "\\{1, 2\\}"),
):
    verify_pair(_pred, _gold)
