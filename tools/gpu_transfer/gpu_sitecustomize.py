"""The transfer kit's ``sitecustomize``: paths that go on ``sys.path`` after the image's site-packages.

``tools/gpu_transfer/gpu_src.sh`` copies it into the folder that goes first on ``PYTHONPATH`` (``.gpu-src`` in
gpu_offline.sh, ``.gpu-replica/src`` in the CPU replica), so every Python process started there, vLLM's
engine-core process and ``qerl run``'s included, appends the folders in ``$QERL_SYS_PATH_AFTER``
(the extracted bundles): the image's torch must win over anything a bundle brings. It then runs the
``sitecustomize`` it shadows (the distribution's), if any. Standard library only.
"""

import os
import sys

for _p in os.environ.get("QERL_SYS_PATH_AFTER", "").split(os.pathsep):
    if _p and _p not in sys.path:
        sys.path.append(_p)
_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:
    _f = os.path.join(_d or ".", "sitecustomize.py")
    if os.path.abspath(_d or ".") != _here and os.path.isfile(_f):
        with open(_f) as _src:
            exec(compile(_src.read(), _f, "exec"), {"__name__": "sitecustomize", "__file__": _f})
        break
