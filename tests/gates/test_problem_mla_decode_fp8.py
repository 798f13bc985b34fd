"""The FP8-cache MLA problem: a calibrated e4m3 cache of mla_decode's inputs, its float64 reference, its cost."""

import pytest
import torch

from gates.problems import DISTRIBUTIONS, Point, load_problem
from model.kimi_k3.ops.mla_decode import mla_decode, paged_rows
from model.kimi_k3.ops.mla_decode_fp8 import E4M3_MAX, mla_decode_fp8, quantize_kv

FP8 = load_problem("mla_decode_fp8")
BF16 = load_problem("mla_decode")
SMALL = Point(3, 0, (("heads", 2), ("kv_lora_rank", 32), ("rope_dim", 8), ("page_size", 16)), "bf16")


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_the_cache_is_calibrated_and_poisoned_outside_the_valid_rows(dist):
    q_nope, q_pe, cache, kv_scale, table, lengths, *_ = FP8.generate_input(SMALL, 5, dist).args
    assert cache.dtype == torch.float8_e4m3fn and kv_scale > 0
    valid = [paged_rows(cache, table[i], torch.arange(int(n))).float() for i, n in enumerate(lengths)]
    assert max(float(rows.abs().max()) for rows in valid) == E4M3_MAX  # the largest valid entry takes e4m3's largest
    poisoned = torch.ones(cache.shape[:2], dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        poisoned[table[i, torch.arange(n) // 16].long(), torch.arange(n) % 16] = False
    assert poisoned.any() and (cache.float()[poisoned] == E4M3_MAX).all()  # the last pages' rest, the spare pages


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_reference_is_the_op_on_the_dequantized_cache(dist):
    args = FP8.generate_input(SMALL, 7, dist).args
    want = FP8.reference(*args)
    assert torch.isfinite(want).all()
    got = mla_decode_fp8(*args)  # fp32 reference math: within fp32 summation of the float64 one
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, float(want.abs().max())), rtol=1e-4)
    q_nope, q_pe, cache, kv_scale, table, lengths, w_uk, w_uv, scale = args
    dequantized = cache.float() * kv_scale
    torch.testing.assert_close(BF16.reference(q_nope, q_pe, dequantized, table, lengths, w_uk, w_uv, scale), want)


def test_quantization_saturates_and_rounds_to_nearest():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1, -500.0, 1e6])
    assert quantize_kv(x, 1.0).float().tolist() == [0.0, 1.0, 1.0, 1.125, -448.0, 448.0]
    assert quantize_kv(x * 2, 2.0).float().tolist() == quantize_kv(x, 1.0).float().tolist()


def test_the_fp8_cache_costs_half_the_bytes():
    fp8, bf16 = FP8.cost(SMALL), BF16.cost(SMALL)
    entries = bf16.bytes - fp8.bytes  # the same rows at one byte instead of two
    assert entries > 0 and fp8.flops == bf16.flops
    q_nope, q_pe, cache, kv_scale, table, lengths, w_uk, w_uv, scale = FP8.generate_input(SMALL, 0, "normal").args
    assert entries == int(lengths.sum()) * cache.shape[-1]


def test_the_op_matches_the_bf16_op_on_the_same_values():
    args = FP8.generate_input(SMALL, 3, "normal").args
    q_nope, q_pe, cache, kv_scale, table, lengths, w_uk, w_uv, scale = args
    torch.testing.assert_close(mla_decode_fp8(*args),
                               mla_decode(q_nope, q_pe, cache.float() * kv_scale, table, lengths, w_uk, w_uv, scale))
