"""moe_compile: a torch.compile backend for Mixture-of-Experts models.

``import moe_compile`` registers the ``"moe_compile"`` backend (the ``torch_dynamo_backends`` entry
point does too, so ``torch.compile(model, backend="moe_compile")`` works without the import), and, where
transformers is imported first, its ``"moe_compile"`` expert-parallel implementation
(:func:`register_hf_expert_parallel`).
"""

import sys

from moe_compile import metrics, ops
from moe_compile.api import compile, explain, last_report
from moe_compile.backend import moe_backend, register
from moe_compile.config import MoECompileConfig
from moe_compile.experts.expert_parallel import register_hf_expert_parallel
from moe_compile.experts.quantize import quantize_experts
from moe_compile.report import Report

register()
if "transformers" in sys.modules:  # DistributedConfig(ep_implementation="moe_compile") then names ours
    register_hf_expert_parallel()

__all__ = ["MoECompileConfig", "Report", "compile", "explain", "last_report", "metrics", "moe_backend", "ops",
           "quantize_experts", "register_hf_expert_parallel"]
