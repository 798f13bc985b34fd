"""The numerics' late writer: a harness kernel that lets the next kernel start, then writes that kernel's inputs (a
PDL kernel reading them before griddepcontrol.wait reads poison); compiled and read in PTX here, run on the GPU."""

import pytest
import torch

from gates.core import late_writer, worker
from kernels.bytes import span
from kernels.cute import cutlass_available

needs_dsl = pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL (nvidia-cutlass-dsl) not installed")


@needs_dsl
def test_it_lets_the_next_kernel_start_before_it_spins_and_writes():
    ptx = late_writer.compile_report().ptx
    body = ptx[ptx.index(".entry"):]
    trigger, timer = body.index("griddepcontrol.launch_dependents;"), body.index("%globaltimer")
    assert trigger < timer < body.index("ld.global") < body.index("st.global")
    assert "griddepcontrol.wait" not in body  # it waits for nothing: the kernel before it is torch's, complete


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6),
    lambda: torch.arange(48, dtype=torch.bfloat16).reshape(4, 12)[:, 2:9],  # a strided, offset view
    lambda: torch.arange(8, dtype=torch.int64)[3:4],
])
def test_a_span_is_the_views_bytes_from_its_first_element_to_its_last(make):
    t = make()
    raw = span(t)
    rebuilt = t.new_empty(0).set_(raw.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    assert torch.equal(rebuilt, t)
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    assert raw.numel() == (last - t.storage_offset() + 1) * t.element_size()


def test_the_leaves_a_predecessor_writes():
    args = (torch.zeros(2), [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)], torch.zeros(3))
    names = ["x", "sources", "addend"]
    assert [n for n, _ in worker.written_leaves(args, names, ("sources[-1]", "addend"))] == ["sources[2]", "addend"]
    assert [n for n, _ in worker.written_leaves(args, names, ("sources", "nope"))] == [
        "sources[0]", "sources[1]", "sources[2]"]


@pytest.mark.gpu
def test_it_copies_the_bytes():
    src = torch.arange(1000, dtype=torch.uint8, device="cuda")
    dst = torch.full_like(src, 0xFF)
    late_writer.late_write(src, dst, spin_ns=1000)
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
