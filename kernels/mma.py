"""Warp-level tensor-core MMA for CuTe DSL kernels that drive the fragments themselves (small-M decode tiles:
MLA's heads, the MoE's tokens on the N side), as inline PTX.

    d = mma_m16n8k16(a, b, c, operand="bf16")   # one warp: D[16, 8] = A[16, 16] B[16, 8] + C, fp32 accumulate

Fragments are PTX's for mma.sync.aligned.m16n8k16.row.col: with lane (g, t) = (lane // 4, lane % 4), a is 4 32-bit
words of operand pairs, A (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); b is 2, B (2t..2t+1, g),
(2t+8.., g); c and d are 4 fp32, C (g, 2t..2t+1), (g+8, 2t..2t+1).
"""

from __future__ import annotations

from kernels.cute import dsl_import, import_cutlass

with dsl_import() as DSL:
    import_cutlass()
    from cutlass import Float32, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T as _T

OPERANDS = ("bf16", "f16")

if DSL.error is None:

    def mma_m16n8k16(a: list, b: list, c: list, operand: str = "bf16") -> list:
        """mma.sync.aligned.m16n8k16.row.col.f32.{operand}.{operand}.f32 (operand one of OPERANDS): d = A B + c
        for one warp, fragments as the module doc lays them out."""
        if operand not in OPERANDS:
            raise ValueError(f"operand {operand!r}: one of {OPERANDS}")
        res = llvm.inline_asm(
            llvm.StructType.get_literal([_T.f32()] * 4),
            [Uint32(x).ir_value() for x in (*a, *b)] + [Float32(x).ir_value() for x in c],
            f"mma.sync.aligned.m16n8k16.row.col.f32.{operand}.{operand}.f32 {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, "
            "{$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Float32(llvm.extractvalue(_T.f32(), res, [i])) for i in range(4)]
