"""fivefold's benchmarks against torch's reference implementations (ships with the source checkout only).

- `harness`: the one timing loop (paired alternating blocks, slowest-rank step time, ratios, tables);
- `torch_collectives`: how the collectives of torch's own implementations are counted;
- `data_parallel`, `tensor_parallel`, `pipeline`: the contestants of each dimension;
- `run`: the command line (``python bench/run.py``, ``make bench``, ``fivefold bench`` from a checkout).
"""
