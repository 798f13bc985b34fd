"""`k3forge contract check / show` and contract loading: every malformed contract gets its named
`file: field: problem` line and exit code 2. Contracts are written to temporary repository roots, so
these tests do not depend on which evidence bundles are committed."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from gates.cli import main
from kernels.contract import ContractError, contract_files, load_contract, parse_contract
from model.kimi_k3.ops.registry import CONTRACTS_DIR, load_specialized, registry_problems
from tests.gates.fixtures.helpers import CPU_EXAMPLE

# The CPU example's contract (validated on cpu): its entry points import on any machine.
VALIDATED = yaml.safe_load(CPU_EXAMPLE.read_text())
# The same contract with its arch declared, not validated: no evidence needed, so one problem shows alone.
BASE = {**VALIDATED, "hardware": {"validated": [], "declared": [{"arch": "cpu", "devices": ["cpu"]}]}}


def write_repo(root, data: dict, name: str = "attn_res"):
    (root / "contracts").mkdir(exist_ok=True)
    (root / "contracts" / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return root


def check(root, capsys) -> tuple[int, list[str], str]:
    """Exit code, the `file: field: problem` lines, stdout."""
    rc = main(["contract", "check", "--root", str(root)])
    out, err = capsys.readouterr()
    return rc, [line for line in err.splitlines() if re.match(r"\S+\.yaml: ", line)], out


def test_the_repository_contracts_pass_with_fresh_evidence(capsys):
    """The committed contracts match the registry, import, and every validated arch's bundle is intact and
    fresh against this tree (edit a kernel, its reference or its contract without re-running the gate: this fails)."""
    files = contract_files(CONTRACTS_DIR)
    assert files, "no contracts committed"
    for path in files:
        assert registry_problems(load_contract(path), str(path)) == []
    assert main(["contract", "check"]) == 0, capsys.readouterr().err


def test_every_committed_bundle_is_intact_and_fresh(capsys):
    """Every bundle under evidence/ (contract bundles of any verdict, the decode bundle) verifies against this
    tree: a change to code a GPU bundle covers re-makes the bundle on the GPU, or moves it out of evidence/ as a
    run's record, in the same change."""
    assert main(["evidence", "verify", "--allow-failed"]) == 0, capsys.readouterr()


def test_a_valid_contract_passes(tmp_path, capsys):
    rc, problems, out = check(write_repo(tmp_path, BASE), capsys)
    assert (rc, problems) == (0, [])
    assert "attn_res" in out and "1 contract(s) pass" in out


def _set(path: str, value):
    def edit(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return edit


def _delete(key: str):
    return lambda d: d.pop(key)


MALFORMED = [
    ("missing field", "attn_res", _delete("owners"), "owners", "Field required"),
    ("wrong type", "attn_res", _set("batch.max", "many"), "batch.max", "valid integer"),
    ("unknown op", "flash_mla", _set("op", "flash_mla"), "op", "unknown op 'flash_mla'"),
    ("unimportable entry point", "attn_res", _set("implementation", "model.kimi_k3.specialized.nowhere:kernel"),
     "implementation", "cannot import model.kimi_k3.specialized.nowhere:kernel (ModuleNotFoundError"),
    ("entry point missing in its module", "attn_res", _set("implementation", "model.kimi_k3.attn_res:fused"),
     "implementation", "cannot import model.kimi_k3.attn_res:fused (AttributeError"),
    ("empty batch range", "attn_res", _set("batch", {"min": 9, "max": 1}), "batch", "empty range: min 9 > max 1"),
    ("zero batch", "attn_res", _set("batch", {"min": 0, "max": 4}), "batch", "min must be >= 1"),
    ("reference not the registry's", "attn_res", _set("reference", "model.kimi_k3.ops.mla_decode:mla_decode"),
     "reference", "is not the registry's reference of attn_res (model.kimi_k3.ops.attn_res:attn_res)"),
    ("unknown dim", "attn_res", lambda d: d["shapes"].update(width=[1]), "shapes.width", "attn_res has no dim 'width'"),
    ("operand the op lacks", "attn_res", _set("dtypes.ssm_state", "fp32"), "dtypes.ssm_state", "no ssm_state operand"),
    ("duplicate TP sizes", "attn_res", _set("tp_sizes", [1, 1]), "tp_sizes", "duplicate TP sizes"),
    ("bad arch", "attn_res", _set("hardware", {"validated": [{"arch": "hopper", "devices": ["x"]}]}),
     "hardware.validated.0.arch", "should match pattern"),
    ("arch listed twice", "attn_res", _set("hardware", {"validated": [{"arch": "cpu", "devices": ["cpu"]}] * 2}),
     "hardware", "an arch is listed twice"),
    ("evidence elsewhere", "attn_res",
     _set("hardware", {"validated": [{"arch": "cpu", "devices": ["cpu"], "evidence": "ev/x"}]}),
     "hardware.validated.0.evidence", "'ev/x' is not where the gate runner writes it (evidence/attn_res/cpu)"),
    ("file name differs from op", "attn_res_v2", lambda d: None, "op", "does not match the file name 'attn_res_v2'"),
]


@pytest.mark.parametrize("name, mutate, field, problem", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_contract_gets_its_named_error(tmp_path, capsys, name, mutate, field, problem):
    data = copy.deepcopy(BASE)
    mutate(data)
    rc, problems, _ = check(write_repo(tmp_path, data, name), capsys)
    assert rc == 2
    assert len(problems) == 1, problems
    assert re.match(rf"\S*contracts/{name}\.yaml: {re.escape(field)}: ", problems[0]), problems[0]
    assert problem in problems[0]


def test_a_validated_arch_without_an_evidence_bundle_fails(tmp_path, capsys):
    rc, problems, _ = check(write_repo(tmp_path, VALIDATED), capsys)
    assert rc == 2 and problems
    assert all("contracts/attn_res.yaml: hardware.validated.0: cpu is validated, but its evidence is not sound" in p
               for p in problems)
    assert any(p.endswith("evidence/attn_res/cpu/bundle.json: missing") for p in problems)


@pytest.mark.parametrize("text, problem", [("op: [unclosed", "not valid YAML"), ("- a list", "expected a mapping")])
def test_a_contract_that_is_not_a_yaml_mapping_fails(tmp_path, capsys, text, problem):
    (tmp_path / "contracts").mkdir()
    (tmp_path / "contracts" / "attn_res.yaml").write_text(text)
    rc, problems, _ = check(tmp_path, capsys)
    assert rc == 2 and len(problems) == 1 and problem in problems[0]


def test_kernels_are_imported_only_where_they_can_run(tmp_path):
    """A GPU-only contract loads on a CPU machine without importing its kernel; the gate (arch=None)
    imports every kernel, so a broken entry point still fails there."""
    data = copy.deepcopy(BASE)
    data["implementation"] = "model.kimi_k3.specialized.not_built_here:kernel"
    data["hardware"] = {"validated": [{"arch": "sm_90", "devices": ["NVIDIA H200"]}], "declared": []}
    write_repo(tmp_path, data)
    assert load_specialized(tmp_path / "contracts", arch="cpu")["attn_res"].fn is None
    with pytest.raises(ContractError, match=r"attn_res\.yaml: implementation: cannot import"):
        load_specialized(tmp_path / "contracts", arch="sm_90")
    with pytest.raises(ContractError, match="cannot import"):
        load_specialized(tmp_path / "contracts")


def test_the_gate_gets_all_three_implementations(tmp_path):
    spec = load_specialized(write_repo(tmp_path, BASE) / "contracts")["attn_res"]
    impls = spec.implementations(gpu=False)
    assert impls.reference is impls.standard  # on CPU the reference is the standard
    assert impls.specialized.__name__ == "attn_res_fused"


def test_show_prints_a_contract_and_its_evidence_status(tmp_path, capsys):
    assert main(["contract", "show", "attn_res", "--root", str(write_repo(tmp_path, VALIDATED))]) == 0
    out = capsys.readouterr().out
    assert "attn_res_fused" in out and "evidence/attn_res/cpu/bundle.json missing" in out and "consistent" in out


def test_show_of_an_unknown_op_is_a_usage_error(tmp_path, capsys):
    assert main(["contract", "show", "flash_mla", "--root", str(write_repo(tmp_path, BASE))]) == 2
    assert "no contract for op 'flash_mla'; contracts: attn_res" in capsys.readouterr().err


def test_check_without_a_contracts_directory_fails(tmp_path, capsys):
    assert main(["contract", "check", "--root", str(tmp_path)]) == 2
    assert "contracts: <dir>: no such contracts directory" in capsys.readouterr().err


def test_a_point_may_state_its_own_bounds():
    data = copy.deepcopy(BASE)
    data["benchmark"] = {"points": [{"batch": 1, "required_speedup": 2.5, "min_roofline_fraction": 0.5}, {"batch": 2}],
                         "required_speedup": 1.5}
    bench = parse_contract(data, "c.yaml").benchmark
    assert [bench.requirement(p) for p in bench.points] == [(2.5, 0.5), (1.5, None)]


def test_the_dispatcher_refuses_a_contract_with_a_key_twice(tmp_path):
    """PyYAML keeps the last of two equal keys; the gates refuse such a file, and so does the dispatcher's loader,
    so a kernel never runs under a bound other than the one it was judged by."""
    text = yaml.safe_dump(BASE, sort_keys=False) + "batch: {min: 1, max: 64}\n"
    (tmp_path / "attn_res.yaml").write_text(text)
    with pytest.raises(ContractError, match=r"attn_res.yaml: <file>: key 'batch' appears twice in one mapping"):
        load_specialized(tmp_path)
