"""The benchmarks live in the checkout's top-level `bench/` (not in the package): make `import bench` find them."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
