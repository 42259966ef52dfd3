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


# The combine weight 4% off is not here: on the H100 (626848b) this 64-token layer's rms error stayed within the
# bound (the CPU cases of tests/passes/test_validate.py refuse it); a raised-precision comparison would see it.
@pytest.mark.parametrize("corrupt", [None, "router_gradient_off_15pct"])
def test_cuda_validation_runs_dispatch_ops_on_the_host_and_still_refuses(monkeypatch, corrupt):
    """On CUDA the dispatch ops run with their CPU references inside validation (no Triton compile per shape):
    a correct rewrite is accepted, a router gradient 15% off is refused, and the compiled layer matches eager."""
    from moe_compile import passes as passes_mod
    from moe_compile.passes import _validate
    from tests.models.handwritten import SortIndexSelectScatterAdd
    from tests.passes import test_validate

    torch.manual_seed(2)
    layer = SortIndexSelectScatterAdd().cuda()
    x = torch.randn(64, layer.router.shape[1], device="cuda", dtype=torch.bfloat16)
    on_host: list[str] = []
    original = _validate._Runner._on_host
    monkeypatch.setattr(_validate._Runner, "_on_host",
                        lambda self, n: on_host.append(str(n.target)) or original(self, n))
    monkeypatch.delenv("MOE_COMPILE_VALIDATE_ALL", raising=False)
    if corrupt is not None:
        _inject(monkeypatch, "fuse_dispatch", getattr(test_validate, corrupt))
        monkeypatch.setattr(passes_mod, "_WARNED_VALIDATION", set())
    run = compile_and_run(layer, (x,), train=True, backend="moe_compile")
    assert any("permute_pad" in t for t in on_host) and any("unpad_unpermute" in t for t in on_host), on_host
    refused = [r for r in run.report.skips if r.what == "validation_failed"]
    assert bool(refused) == (corrupt is not None), run.report.table()
    assert run.report.count("fuse_dispatch") == (0 if corrupt else 1) and not run.report.unchecked
    assert_matches_eager(run, layer, (x,), train=True)
