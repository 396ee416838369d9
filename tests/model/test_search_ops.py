"""The search side's operations (model/engine/search_ops.py): which implementation a session runs.
That the two give the same results is tests/model/test_fused.py's and test_decoding.py's."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from model.engine import fused
from model.engine.beams import Beams
from model.engine.decoding import DecodeSession
from model.engine.features import detected, fused_variant
from model.engine.options import DecodingOptions
from model.engine.search_ops import FusedSearchOps, TensorSearchOps, search_ops
from tests.factories import make_model
from tests.helpers import require


def test_the_fused_ops_run_on_the_cpu_with_kernels_and_the_tensor_ops_otherwise() -> None:
    """``search_ops`` chooses from the loaded kernels and the device alone (a stand-in module: the
    choice reads nothing else of it than its row copy)."""
    kernels = ModuleType("kernels")
    kernels.gather_rows_ = lambda *args: None  # type: ignore[attr-defined]
    ops = search_ops(kernels, torch.device("cpu"))
    assert isinstance(ops, FusedSearchOps)
    assert ops.gather_rows is kernels.gather_rows_ and ops.advances_some_rows
    for device in ("cuda", "meta"):  # the kernels run on the CPU alone
        assert isinstance(search_ops(kernels, torch.device(device)), TensorSearchOps)
    tensor = search_ops(None, torch.device("cpu"))
    assert isinstance(tensor, TensorSearchOps)
    assert tensor.gather_rows is None and not tensor.advances_some_rows


def test_the_tensor_advance_refuses_the_logits_of_some_rows() -> None:
    """Only the fused kernels' advance takes a step that computed some rows."""
    beams = Beams(2, 0, torch.device("cpu"))
    beams.extend(1, 3)
    with pytest.raises(ValueError, match="some rows"):
        TensorSearchOps().advance(beams, torch.zeros(1, 7), torch.zeros(1, dtype=torch.long), 0, 0.6, 3,
                                  rows=torch.tensor([0, -1]))  # fmt: skip


@pytest.mark.isa
@pytest.mark.usefixtures("fused_kernels")
def test_a_session_runs_the_search_on_the_kernels_its_model_names() -> None:
    variant = fused_variant(detected())
    require(fused.load(variant) is not None, f"the fused step kernels ({variant}) do not build here: see the log")
    model = make_model()
    assert isinstance(DecodeSession(model, DecodingOptions(beam_size=2))._search, TensorSearchOps)
    model.fused_step = variant
    assert isinstance(DecodeSession(model, DecodingOptions(beam_size=2))._search, FusedSearchOps)
