"""The candidate's process: persistent buffers across cases that differ in shape (an MLA cache of another context)."""
import pytest
import torch

from gates.core import worker
from gates.problems import Case


def _cases() -> list[Case]:
    return [Case(args=(torch.arange(float(n)).reshape(1, n), 2.0)) for n in (4, 7, 4)]


def test_cases_of_different_shapes_each_get_buffers_of_their_shape():
    out = worker.run_cases(candidate="torch:mul", reference="torch:mul", device="cpu", names=["x", "s"],
                           cases=_cases(), runs=2, output_specs=[((1, 7), torch.float32)])
    first_runs = [per_run[0] for per_run in out["cases"]]
    assert all("raised" not in run for run in first_runs)
    assert [run["outputs"][0][1].shape[-1] for run in first_runs] == [4, 7, 4]
    assert torch.equal(first_runs[1]["outputs"][0][1], torch.arange(7.0).reshape(1, 7) * 2)


def test_calls_cycling_through_cases_of_different_shapes():
    out = worker.run_calls(candidate="torch:mul", device="cpu", names=["x", "s"], cases=_cases(), calls=6)
    assert len(out["calls"]) == 6 and all("raised" not in c for c in out["calls"])


def test_one_buffer_set_per_layout():
    pool: list = []
    guards = worker.Guards()
    a, b, c = (worker.persistent_buffers(pool, case.args, guards) for case in _cases())
    assert a is c and a is not b and len(pool) == 2


def test_guarded_tensors_keep_their_layout_and_contents_and_report_writes_outside_them():
    guards = worker.Guards()
    state = torch.randn(3, 5, 8)[:, :, ::2]  # a strided view: its copy is dense, with its own strides
    args = (state, {"w": torch.arange(6, dtype=torch.int32)}, 1.5)
    placed = guards.place(args)
    assert torch.equal(placed[0], state) and torch.equal(placed[1]["w"], args[1]["w"]) and placed[2] == 1.5
    buffer, start, _ = guards.zones[id(placed[0])]
    assert placed[0].data_ptr() == buffer.data_ptr() + start and start % worker.GUARD_BYTES == 0
    assert placed[0].is_contiguous()
    names = ["state", "w", "scale"]
    assert guards.overruns(placed, names) == []
    placed[0].mul_(2)  # inside: not an overrun
    assert guards.overruns(placed, names) == []
    beyond = placed[0].new_empty(0).set_(placed[0].untyped_storage(), placed[0].storage_offset() + placed[0].numel(),
                                         (2,), (1,))
    beyond.fill_(1.0)  # the two elements just past the end
    before = placed[1]["w"].new_empty(0).set_(placed[1]["w"].untyped_storage(),
                                             placed[1]["w"].storage_offset() - 1, (1,), (1,))
    before.fill_(7)
    found = guards.overruns(placed, names)
    assert len(found) == 2 and found[0].startswith("8 byte(s) after state") and "before w['w']" in found[1]
    assert guards.overruns(placed, names) == []  # the zones are whole again: the next call answers for itself


def test_each_run_puts_other_bytes_around_the_tensors():
    """run_cases refills the zones before each run, so what a call reads past its tensors changes from run to run,
    and a write is still found against the byte the zones hold now."""
    guards = worker.Guards()
    placed = guards.place((torch.zeros(4),))
    names = ["x"]
    buffer, start, end = guards.zones[id(placed[0])]
    seen = []
    for canary in worker.CANARIES:
        guards.refill(canary)
        assert bool((buffer[:start] == canary).all()) and bool((buffer[end:] == canary).all())
        assert torch.equal(placed[0], torch.zeros(4)) and guards.overruns(placed, names) == []
        seen.append(placed[0].new_empty(0).set_(placed[0].untyped_storage(), placed[0].storage_offset() + 4, (1,),
                                                (1,)).item())
    assert len(set(map(repr, seen))) == len(worker.CANARIES) and any(v != v for v in seen)  # NaN among them
    buffer[end] = 0  # a write past the end, against the last canary
    assert len(guards.overruns(placed, names)) == 1


def test_a_zone_is_at_least_one_slice_of_the_leading_dimension():
    """A cache slot is 64 KiB: a write to the slot one past the end lands inside the zone after the cache."""
    guards = worker.Guards()
    cache = guards.place(torch.zeros(4, 128, 128))
    buffer, start, end = guards.zones[id(cache)]
    assert start >= cache.stride(0) * cache.element_size() and buffer.numel() - end == start


def test_the_l2_calls_the_benchmarks_rely_on_are_guarded():
    """A candidate that replaced cudaDeviceGetLimit could report no set-aside: the worker reports the replacement,
    and the screen fails code that assigns to it."""
    from gates.core.l2 import L2_CALLS

    assert {f"cuda.bindings.runtime.{name}" for name in L2_CALLS} <= set(worker.GUARDED)


def test_poison_reads_as_poison_in_every_dtype():
    """What run_concurrent fills a call's buffers with before the call's own stream writes its inputs."""
    args = (torch.zeros(3), (torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.bool)), 1.5)
    worker.poison_(args)
    assert args[0].isnan().all() and (args[1][0] == torch.iinfo(torch.int32).max).all() and args[1][1].all()


@pytest.mark.gpu
def test_scratch_allocated_after_poison_reads_poison():
    """Memory fresh from the driver reads as zeros, which hides a kernel that never clears its scratch: after
    poison() every size the allocator serves, from both pools, comes from a poisoned block."""
    torch.empty(3 << 20, dtype=torch.uint8, device="cuda").zero_()  # a cached block that poison must not leave
    worker.poison([((16,), torch.float32)], "cuda")
    # every scratch taken before anything is compared: a comparison's own result (a bool tensor of ones) is freed
    # into the cache too, and the next scratch would be carved from it (session 33's H100 failed 4096 so)
    sizes = (256, 4096, 1 << 20, 3 << 20, 100 << 20)
    scratches = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for nbytes in sizes]
    output = torch.empty(16, device="cuda")
    for nbytes, scratch in zip(sizes, scratches):
        assert bool((scratch == 0xFF).all()), nbytes
    assert output.isnan().all()
