"""ridethrough's shim bootstrap: ``ridethrough run`` puts this directory first on the ranks' PYTHONPATH.

With ``RIDETHROUGH_SHIM=1`` it boots the shim (`ridethrough.actuators.shim.boot`) before the
script runs; otherwise it does nothing. Either way, it then runs the ``sitecustomize`` it hides,
if the environment has one further down the path.
"""

import importlib.util
import os
import sys

if os.environ.get("RIDETHROUGH_SHIM") == "1":
    from ridethrough.actuators.shim.boot import boot_from_site

    boot_from_site()

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _chained = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_chained)
