"""model.linear: oneDNN with packed weights at inference, F.linear (autograd) otherwise."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from model import linear as linear_mod
from model.linear import Linear, linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 48), (3, 1, 48), (0, 48)])
def test_inference_matches_f_linear(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    layer = Linear(48, 70).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    with torch.inference_mode():
        out = layer(x)
        expected = F.linear(x, layer.weight, layer.bias)
    assert out.shape == (*shape[:-1], 70)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_packed_copy_follows_in_place_updates_and_is_freed() -> None:
    torch.manual_seed(1)
    layer = Linear(16, 8, bias=False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(-2.0)  # what an optimizer step does: in place, version bumped
        after = layer(x)
    torch.testing.assert_close(after, before * -2.0, atol=1e-5, rtol=1e-5)
    if linear_mod.ONEDNN:
        assert id(layer.weight) in linear_mod._packed
        key = id(layer.weight)
        del layer
        gc.collect()
        assert key not in linear_mod._packed


def test_training_path_has_gradients() -> None:
    layer = Linear(6, 3)
    x = torch.randn(2, 6, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    torch.testing.assert_close(layer.weight.grad, torch.ones(3, 1) * x.detach().sum(0))
    assert linear(x, layer.weight).requires_grad


def test_autocast_regions_keep_f_linear_semantics() -> None:
    """The trainer validates under CPU bf16 autocast with no gradients: inputs are cast as usual."""
    torch.manual_seed(2)
    first, second = Linear(16, 32), Linear(32, 8)
    x = torch.randn(3, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = first(x)
        out = second(torch.relu(h))
        expected = F.linear(torch.relu(F.linear(x, first.weight, first.bias)), second.weight, second.bias)
    assert h.dtype == out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    with torch.no_grad(), pytest.raises(RuntimeError):  # mixed dtypes, no autocast: F.linear's error
        second(h)
