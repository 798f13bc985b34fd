"""Modules whose parameters are declared by their checkpoint bindings (rank-local shapes from one description)."""

from __future__ import annotations

import torch
from torch import nn

from .parallel import TP
from .weights import Binding, single


def param_dtype(ckpt_dtype: torch.dtype, act_dtype: torch.dtype) -> torch.dtype:
    """bf16 checkpoint tensors run in the activation dtype; fp32 and packed integer tensors keep theirs."""
    return act_dtype if ckpt_dtype == torch.bfloat16 else ckpt_dtype


class Weighted(nn.Module):
    """A module that owns checkpoint-backed parameters. Checkpoint names are absolute (before any
    `language_model.` prefix); parameter names are relative to the module."""

    def __init__(self, tp: TP, act_dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.act_dtype = act_dtype
        self.weight_bindings: list[Binding] = []

    def declare(self, binding: Binding) -> nn.Parameter:
        """Create the parameter a binding fills, with its rank-local shape."""
        dtype = param_dtype(binding.parts[0].tensor.dtype, self.act_dtype)
        p = nn.Parameter(torch.empty(binding.local_shape(self.tp), dtype=dtype), requires_grad=False)
        self.register_parameter(binding.param, p)
        self.weight_bindings.append(binding)
        return p

    def declare_stacked(self, bindings: list[Binding]) -> nn.Parameter:
        """One [N, ...] parameter whose row i is filled by bindings[i] (all share a parameter name)."""
        first = bindings[0]
        dtype = param_dtype(first.parts[0].tensor.dtype, self.act_dtype)
        shape = (len(bindings), *first.local_shape(self.tp))
        p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.register_parameter(first.param, p)
        self.weight_bindings.extend(bindings)
        return p


class RMSNorm(Weighted):
    """A checkpoint-backed RMSNorm weight (replicated)."""

    def __init__(self, ckpt_name: str, dim: int, eps: float, tp: TP, act_dtype: torch.dtype):
        super().__init__(tp, act_dtype)
        self.eps = eps
        self.declare(single("weight", ckpt_name, (dim,), torch.bfloat16, "ones"))

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.call("rms_norm", x, self.weight, self.eps)
