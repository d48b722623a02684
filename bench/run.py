"""Benchmark fivefold against torch's reference implementations on local gloo CPU ranks.

    python bench/run.py ddp                       # preset small; defaults sized for ~1-2 min on 2 cores
    python bench/run.py ddp --preset tiny --steps 10 --json out.json
    python bench/run.py zero                      # ZeRO 0-3 vs torch DDP / ZeroRedundancyOptimizer / FSDP2
    python bench/run.py zero --stages 0,3         # a subset (each fivefold stage brings its counterpart)
    python bench/run.py all --json out.json       # ddp, then zero

Same as ``fivefold bench ddp ...``; the harness lives in `fivefold.bench`.
"""

from __future__ import annotations

import sys

from fivefold.bench import main

if __name__ == "__main__":
    sys.exit(main())
