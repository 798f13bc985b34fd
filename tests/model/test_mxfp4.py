"""MXFP4 packing against an independent E2M1 table and compressed-tensors' own unpacker."""

import pytest
import torch

from model.kimi_k3 import mxfp4


# E2M1 decoded from its bit fields (sign, 2-bit exponent with bias 1, 1-bit mantissa; exponent 0 is
# subnormal), independent of the table in the module under test.
def e2m1_from_bits(code: int) -> float:
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def test_every_code_decodes_to_its_bit_fields():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8)
    packed = packed.repeat(1, 2)  # one 32-wide group
    scale = torch.full((1, 1), 127, dtype=torch.uint8)  # 2^0
    got = mxfp4.dequantize(packed, scale)[0, :16].tolist()
    assert got == [e2m1_from_bits(c) for c in range(16)]


def test_scale_is_a_power_of_two_per_group():
    codes = torch.full((1, 16), 0x22, dtype=torch.uint8)  # every value code 2 = 1.0
    scale = torch.tensor([[130]], dtype=torch.uint8)  # 2^3
    assert torch.all(mxfp4.dequantize(codes, scale) == 8.0)


@pytest.mark.parametrize("shape", [(4, 64), (3, 96), (8, 32)])
def test_round_trip_is_exact_on_representable_values(shape):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, shape, generator=g)
    exps = torch.randint(-6, 6, (shape[0], shape[1] // 32), generator=g)
    values = torch.tensor([e2m1_from_bits(int(c)) for c in codes.flatten()]).view(shape)
    # make each group's largest magnitude 6 or 4 so its scale is exactly the drawn exponent
    values[:, ::32] = 6.0
    dense = values * torch.exp2(exps.float()).repeat_interleave(32, dim=1)
    packed, scale = mxfp4.quantize(dense)
    assert torch.equal(mxfp4.dequantize(packed, scale), dense)


def test_quantization_error_is_bounded():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    packed, scale = mxfp4.quantize(w)
    back = mxfp4.dequantize(packed, scale)
    unit = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)
    # rounding costs at most half the largest gap (4 -> 6), clamping the OCP scale's headroom (< 8) to 6 at most 2
    assert torch.all((back - w).abs() <= 2 * unit + 1e-6)
    assert (back - w).norm() / w.norm() < 0.15


def test_ties_round_to_even_codes():
    scaled = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75])
    assert mxfp4.e2m1_encode(scaled).tolist() == [0, 2, 2, 4, 4, 6, 6, 0b1010]


def test_matches_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    mx = pytest.importorskip("compressed_tensors.compressors.mx_utils")
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    packed, scale = mxfp4.quantize(w)
    ours = mxfp4.dequantize(packed, scale)
    unscaled = helpers.unpack_fp4_from_uint8(packed, 8, 64, dtype=torch.float32)
    theirs = unscaled * mx.decompress_mx_scale(scale).float().repeat_interleave(32, dim=1)
    assert torch.equal(ours, theirs)
    # and their packer, given the same E2M1 values, produces our bytes
    assert torch.equal(helpers.pack_fp4_to_uint8(unscaled), packed)
