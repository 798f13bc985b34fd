"""Which files evidence depends on: the static import closure and the roles the contract gives them."""

from gates.bundle import covered_sources
from gates.problems import load_problem
from gates.sources import REPO_ROOT, import_closure, relative
from kernels.contract import load_contract
from tests.gates.fixtures.helpers import KDA_CONTRACT, kda_contract


def test_closure_follows_relative_imports_and_package_inits():
    files = {relative(p) for p in import_closure(["model.kimi_k3.kda"])}
    assert {"model/kimi_k3/kda.py", "model/kimi_k3/ops/kda.py", "model/kimi_k3/__init__.py",
            "model/__init__.py", "model/kimi_k3/ops/__init__.py"} <= files
    assert all((REPO_ROOT / f).is_file() for f in files)  # nothing outside the repository (torch, ...)


def test_contract_roles():
    sources = covered_sources(kda_contract(), KDA_CONTRACT, load_problem("kda_decode").source)
    roles = {s.path: s.roles for s in sources}
    assert roles["tests/gates/fixtures/contracts/kda_decode.yaml"] == ["contract"]
    assert roles["gates/problems/kda_decode.py"] == ["problem"]
    assert roles["tests/gates/fixtures/kda_candidate.py"] == ["implementation"]
    assert roles["model/kimi_k3/ops/kda.py"] == ["reference"]
    assert roles["model/kimi_k3/ops/kda_standard.py"] == ["standard"]
    assert [p for p in roles if p.startswith("gates/")] == ["gates/problems/kda_decode.py"]  # not the harness
    assert all(len(s.sha256) == 64 for s in sources)


def test_one_file_in_two_roles():
    contract = load_contract(REPO_ROOT / "contracts" / "attn_res.yaml")
    sources = covered_sources(contract, REPO_ROOT / "contracts" / "attn_res.yaml", load_problem("attn_res").source)
    roles = {s.path: s.roles for s in sources}
    assert roles["model/kimi_k3/attn_res.py"] == ["reference", "standard"]
    assert roles["model/kimi_k3/specialized/attn_res_fused.py"] == ["implementation"]
