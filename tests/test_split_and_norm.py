"""Pure checks of two pieces every layout relies on: pipeline stage cuts and the global norm.

Stages cut by module names, chained, give exactly the whole model (each parameter on one stage, the
output bit-equal), and `keep_only` refuses what it cannot cut cleanly; the global norm over
placements sums each one over exactly the dimensions its group is partitioned over (values by hand),
naming a missing `Comm`. No process is started."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fivefold.models import build_model, get_config
from fivefold.models.parallelize import build_stages
from fivefold.models.plans import llama_stage_modules
from fivefold.optim.clip import global_grad_sq_norm
from fivefold.pipeline.split import keep_only

CFG = get_config("tiny", n_layers=5, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16, vocab_size=19)


@pytest.mark.parametrize("n_stages, layers", [(2, None), (3, None), (3, [1, 0, 4]), (5, None)])
def test_stages_chained_equal_the_whole_model(n_stages, layers):
    model = build_model(CFG, seed=3)
    stages = build_stages(CFG, range(n_stages), n_stages, seed=3, layers_per_stage=layers)
    whole = dict(model.named_parameters())
    for s, stage in stages.items():  # single-process names and values, each parameter on one stage
        for name, p in stage.named_parameters():
            assert torch.equal(p, whole.pop(name)), (s, name)
    assert not whole
    tokens = torch.randint(0, CFG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    h = tokens
    for s in range(n_stages):
        h = stages[s](h)
    assert torch.equal(h, model(tokens))


def test_stage_module_names_follow_the_plan():
    assert llama_stage_modules(CFG, 2) == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                                           ["layers.3", "layers.4", "norm", "output"]]


def test_keep_only_refuses_what_it_cannot_cut_cleanly():
    with pytest.raises(ValueError, match=r"cannot keep \['layers.9'\]: no such module"):
        keep_only(build_model(CFG), ["layers.9"])
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="indices after it would shift and rename parameters"):
        keep_only(seq, ["1"])


class _Comm:
    """The part of `Comm` the norm uses, for a group of one (no collective)."""

    size = 1


def test_norm_sums_each_placement_over_its_dimensions_only():
    parts = [{frozenset({"tp", "dp"}): torch.tensor(4.0), frozenset(): torch.tensor(1.0)},
             {frozenset({"tp", "dp"}): torch.tensor(2.0), frozenset({"pp"}): torch.tensor(3.0)}]
    comms = {"tp": _Comm(), "dp": _Comm(), "pp": _Comm()}
    assert global_grad_sq_norm(parts, comms).item() == 10.0
    assert global_grad_sq_norm([], {}).item() == 0.0
    with pytest.raises(ValueError, match=r"partitioned over \['tp'\] but no Comm was given"):
        global_grad_sq_norm(parts, {"dp": _Comm(), "pp": _Comm()})
