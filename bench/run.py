"""Benchmark fivefold against torch's reference implementations on local gloo CPU ranks.

    python bench/run.py ddp                       # preset small, defaults sized for ~1-3 min on 2 cores
    python bench/run.py ddp --preset tiny --steps 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fivefold.bench import bench_ddp, format_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    ddp = sub.add_parser("ddp", help="fivefold DDP vs torch DistributedDataParallel")
    ddp.add_argument("--preset", default="small")
    ddp.add_argument("--world", type=int, default=2, help="number of gloo ranks")
    ddp.add_argument("--steps", type=int, default=30, help="timed steps per implementation")
    ddp.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation")
    ddp.add_argument("--repeats", type=int, default=6, help="alternating blocks the timed steps are split into")
    ddp.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    ddp.add_argument("--seq-len", type=int, default=128)
    ddp.add_argument("--bucket-mb", type=float, default=25.0)
    ddp.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ddp.add_argument("--json", metavar="PATH", help="also write the full result (every step) as JSON")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    results = bench_ddp(preset=args.preset, world=args.world, steps=args.steps, warmup=args.warmup,
                        repeats=args.repeats, micro_batch=args.micro_batch, seq_len=args.seq_len,
                        bucket_mb=args.bucket_mb, threads=args.threads)
    print(format_table(results))
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
