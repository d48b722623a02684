"""`fivefold.ops.linear`: deferred weight gradients (zero-bubble W) equal autograd's.

Plain F.linear outside a recording forward; after one, backward returns the input gradient only (no
weight gradient, no hook) and `WeightGradStore.run` later adds exactly the weight and bias gradients
autograd would have, through AccumulateGrad so hooks fire once. Single process, no spawn."""

from __future__ import annotations

import torch
from tolerance import assert_values_close

from fivefold.ops import Linear, WeightGradStore, recording_weight_grads


def _layer(bias: bool) -> Linear:
    torch.manual_seed(0)
    return Linear(5, 3, bias=bias)


def test_plain_outside_a_recording_forward():
    layer, x = _layer(True), torch.randn(2, 4, 5)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert isinstance(layer, torch.nn.Linear)


def test_deferred_weight_and_bias_gradients_equal_autograd():
    for bias in (True, False):
        ref, layer = _layer(bias), _layer(bias)
        x = torch.randn(2, 4, 5, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        ref(x_ref).pow(2).sum().backward()

        store = WeightGradStore()
        with recording_weight_grads(store):
            out = layer(x)
        hooked: list[str] = []
        layer.weight.register_post_accumulate_grad_hook(lambda p, hooked=hooked: hooked.append("weight"))
        store.current = ("stage0", 0)
        out.pow(2).sum().backward()  # I
        assert layer.weight.grad is None and (layer.bias is None or layer.bias.grad is None) and not hooked
        assert torch.equal(x.grad, x_ref.grad)  # I: the same matmul as autograd's
        assert store.pending() == 1
        store.run(("stage0", 0))  # W
        assert store.pending() == 0 and hooked == ["weight"]
        # W's own matmul may sum a gradient entry's 2 x 4 tokens in another order than autograd's (rule 1 of
        # tests/tolerance.py, 8 terms; the scale: the layer's largest gradient entry)
        scale = max(p.grad.abs().max() for p in ref.parameters())
        assert_values_close(layer.weight.grad, ref.weight.grad, 8, "weight", scale=scale)
        if bias:
            assert_values_close(layer.bias.grad, ref.bias.grad, 8, "bias", scale=scale)


def test_a_linear_on_an_input_without_gradient_is_not_deferred():
    """The first layer of a stage fed raw inputs: no I pass exists to split off, so its weight gradient must come
    from the one backward there is (deferring it would lose it)."""
    layer, ref = _layer(True), _layer(True)
    x = torch.randn(4, 5)  # requires no grad
    store = WeightGradStore()
    with recording_weight_grads(store):
        out = torch.nn.functional.layer_norm(layer(x), (3,))
    out.pow(2).sum().backward()
    torch.nn.functional.layer_norm(ref(x), (3,)).pow(2).sum().backward()
    assert store.pending() == 0
    assert torch.equal(layer.weight.grad, ref.weight.grad) and torch.equal(layer.bias.grad, ref.bias.grad)  # one path
