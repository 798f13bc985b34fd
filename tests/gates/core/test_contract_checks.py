"""The gate's contract stage: registry, imports (in a spawned process) and evidence of validated archs."""

from gates.core.contracts import check_contracts, evidence_problems
from tests.gates.fixtures.helpers import KDA_CONTRACT, kda_contract, write_contract

SM90 = {"arch": "sm_90", "devices": ["NVIDIA H200"]}


def test_registry_and_import_problems_name_file_and_field(tmp_path):
    write_contract(tmp_path, standard="model.kimi_k3.ops.kda:kda_decode",
                   implementation="model.kimi_k3.specialized.nowhere:kda_decode")
    problems = check_contracts(tmp_path, tmp_path / "evidence")
    assert any(p.startswith(f"{tmp_path / 'kda_decode.yaml'}: standard: model.kimi_k3.ops.kda:kda_decode is not "
                            "the registry's standard") for p in problems), problems
    assert any("implementation: cannot import model.kimi_k3.specialized.nowhere:kda_decode (ModuleNotFoundError"
               in p for p in problems), problems


def test_validated_arch_needs_sound_evidence(tmp_path):
    contract = kda_contract(hardware={"validated": [SM90]})
    (problem, *_) = evidence_problems(KDA_CONTRACT, contract, tmp_path, producing_arch="cpu")
    assert "hardware.validated.0: sm_90 is validated, but its evidence is not sound" in problem
    assert f"{tmp_path}/kda_decode/sm_90/manifest.json: missing" in problem


def test_the_arch_being_gated_is_not_required_yet(tmp_path):
    contract = kda_contract(hardware={"validated": [SM90]})
    assert evidence_problems(KDA_CONTRACT, contract, tmp_path, producing_arch="sm_90") == []


def test_a_missing_directory():
    assert check_contracts("no/such/dir") == ["no/such/dir: <dir>: no such contracts directory"]
