"""Translation validation on CUDA: the passes whose rewrites exist only there, and a rewritten dispatch validated
through the real backend on the graph's own device (Triton kernels in the rewritten graph)."""

from __future__ import annotations

import pytest
import torch

from moe_compile.backend import ConfiguredBackend
from moe_compile.config import make_config
from tests.passes._harness import assert_matches_eager, compile_and_run
from tests.passes.test_validate import _inject, scale_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_wrong_deterministic_attention_rewrite_is_refused(monkeypatch):
    from moe_compile import passes as passes_mod
    from tests.passes.test_causal_mask import Attention

    torch.manual_seed(0)
    model = Attention("none", dim=64, heads=4).cuda().to(torch.bfloat16)
    x = torch.randn(2, 128, 64, device="cuda", dtype=torch.bfloat16)
    config = make_config(deterministic=True)
    _inject(monkeypatch, "deterministic_attention", scale_forward)
    monkeypatch.setattr(passes_mod, "_WARNED_VALIDATION", set())
    run = compile_and_run(model, (x,), train=True, backend=ConfiguredBackend(config))
    refused = [r for r in run.report.skips
               if r.pass_name == "deterministic_attention" and r.what == "validation_failed"]
    assert refused and run.report.count("deterministic_attention") == 0, run.report.table()
    assert_matches_eager(run, model, (x,), train=True)


def test_cuda_dispatch_rewrite_is_validated_not_unchecked():
    from tests.models.handwritten import SortIndexSelectScatterAdd

    torch.manual_seed(1)
    layer = SortIndexSelectScatterAdd().cuda()
    x = torch.randn(64, layer.router.shape[1], device="cuda", dtype=torch.bfloat16)
    run = compile_and_run(layer, (x,), train=True, backend="moe_compile")
    assert run.report.count("fuse_dispatch") == 1 and not run.report.unchecked, run.report.table()
    assert_matches_eager(run, layer, (x,), train=True)
