"""Benchmark fivefold against torch's reference implementations on local gloo CPU ranks.

    python bench/run.py ddp                       # preset small; defaults sized for ~1-2 min on 2 cores
    python bench/run.py ddp --preset tiny --steps 10 --json out.json
    python bench/run.py zero                      # ZeRO 0-3 vs torch DDP / ZeroRedundancyOptimizer / FSDP2
    python bench/run.py zero --stages 0,3         # a subset (each fivefold stage brings its counterpart)
    python bench/run.py all --json out.json       # ddp, then zero
    python bench/run.py tp                        # TP (and TP+SP) vs torch DTensor TP, tp 2
    python bench/run.py pp                        # schedules vs torch.distributed.pipelining, P 2
    python bench/run.py parallel                  # tp, then pp

Same as ``fivefold bench ...``; the harnesses live in `fivefold.bench` and `fivefold.bench_parallel`.
"""

from __future__ import annotations

import sys

from fivefold.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
