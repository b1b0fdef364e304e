"""Strict collectives (tests/strict_collectives.py) in every Python process a test launches.

tests/conftest.py puts this folder on PYTHONPATH and sets MEGAMAMBA_STRICT_COLLECTIVES=1, so the
ranks that the deepspeed launcher starts for a test run in strict mode too.
"""

import importlib.util
import os
import sys

if (
    os.environ.get("MEGAMAMBA_STRICT_COLLECTIVES") == "1"
    and "strict_collectives" not in sys.modules
    and importlib.util.find_spec("torch") is not None
):  # an interpreter without torch has no collectives
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "strict_collectives.py")
    _spec = importlib.util.spec_from_file_location("strict_collectives", _path)
    sys.modules["strict_collectives"] = _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install()
