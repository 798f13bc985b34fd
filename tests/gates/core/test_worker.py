"""The candidate's process: persistent buffers across cases that differ in shape (an MLA cache of another context)."""
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
    a, b, c = (worker.persistent_buffers(pool, case.args) for case in _cases())
    assert a is c and a is not b and len(pool) == 2
