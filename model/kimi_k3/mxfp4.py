"""MXFP4 as compressed-tensors stores it (`mxfp4-pack-quantized`).

E2M1 values, two per byte along the input dimension (even index in the low nibble), and one E8M0 scale
per 32 inputs (`2 ** (byte - 127)`).
"""

from __future__ import annotations

import torch

from .config import MXFP4_GROUP

# Magnitudes of the 8 E2M1 codes; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Rounding boundaries between neighbouring magnitudes; a value exactly on one rounds to the even code.
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_TIES = (0.75, 1.75, 3.5)  # the boundaries whose upper neighbour is the even code


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8, sign in bit 3) of values already scaled into [-6, 6]; ties to even."""
    mag = x.abs()
    code = torch.bucketize(mag, torch.tensor(_BOUNDS, device=x.device, dtype=mag.dtype))
    for tie in _ROUND_UP_TIES:
        code = code + (mag == tie).long()
    code = code.to(torch.uint8)
    return code | (((x < 0) & (code > 0)).to(torch.uint8) << 3)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [N, K] weight -> (packed uint8 [N, K/2], E8M0 scale uint8 [N, K/32]).

    The shared scale is the power of two that maps the group's largest magnitude into E2M1's range
    (OCP MX: 2^(floor(log2(amax)) - 2), E2M1's largest exponent being 2); values round to the nearest code.
    """
    n, k = w.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"mxfp4.quantize: input dim {k} is not a multiple of {MXFP4_GROUP}")
    groups = w.float().reshape(n, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    exp = torch.floor(torch.log2(amax.clamp_min(2.0**-125))) - 2
    scaled = (groups / torch.exp2(exp)).clamp(-E2M1_MAX, E2M1_MAX)
    code = e2m1_encode(scaled).reshape(n, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    scale = (exp.squeeze(-1) + 127).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed [..., N, K/2], scale [..., N, K/32]) -> dense [..., N, K] (exact in fp32)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    table = torch.cat([mags, -mags])
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    factors = torch.exp2(scale.float() - 127.0)
    values = table[codes].unflatten(-1, (-1, MXFP4_GROUP)) * factors.unsqueeze(-1)
    return values.flatten(-2).to(dtype)
