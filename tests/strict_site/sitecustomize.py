"""What every Python process a test launches gets: strict collectives (tests/strict_collectives.py),
and an exit without the final garbage collections.

tests/conftest.py puts this folder on PYTHONPATH and sets MEGAMAMBA_STRICT_COLLECTIVES=1, so the
ranks that the deepspeed launcher starts for a test run in strict mode too. At exit a rank spent
about 1 s of CPU collecting what torch, DeepSpeed and the TorchDynamo/Inductor modules DeepSpeed
imports leave behind (0.18 s with the objects frozen): hundreds of ranks per suite on two cores.
Freezing runs after every other exit handler (registered first, run last); Triton's bindings then
report their objects as leaked on stderr, which no test reads.
"""

import atexit
import gc
import importlib.util
import os
import sys

atexit.register(gc.freeze)

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
