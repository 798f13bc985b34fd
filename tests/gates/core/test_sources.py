"""Which files evidence depends on: the static import closure and the roles the contract gives them."""

from gates.core.sources import REPO_ROOT, import_closure, relative
from gates.evidence.bundle import covered_sources
from gates.problems import load_problem
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
    assert roles["model/kimi_k3/ops/kda_decode_standard.py"] == ["standard"]
    assert [p for p in roles if p.startswith("gates/")] == ["gates/problems/kda_decode.py"]  # not the harness
    assert all(len(s.sha256) == 64 for s in sources)


def test_one_file_in_two_roles():
    contract = load_contract(REPO_ROOT / "contracts" / "attn_res.yaml")
    sources = covered_sources(contract, REPO_ROOT / "contracts" / "attn_res.yaml", load_problem("attn_res").source)
    roles = {s.path: s.roles for s in sources}
    assert roles["model/kimi_k3/attn_res.py"] == ["reference", "standard"]
    assert roles["model/kimi_k3/specialized/attn_res_fused.py"] == ["implementation"]


def test_the_harness_digest_follows_the_gate_code_only(tmp_path):
    from gates.core.sources import harness_digest

    for name, text in {"gates/checks/numerics.py": "TOL = 1\n", "gates/evidence/templates/report.html.j2": "<p>\n",
                       "kernels/timing.py": "FLUSH = 2\n", "kernels/gpu_session.sh": "echo\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = harness_digest(tmp_path)
    (tmp_path / "gates/evidence/templates/report.html.j2").write_text("<div>\n")
    (tmp_path / "kernels/gpu_session.sh").write_text("echo again\n")
    assert harness_digest(tmp_path) == before  # rendering and session scripts judge nothing
    (tmp_path / "kernels/timing.py").write_text("FLUSH = 3\n")
    assert harness_digest(tmp_path) != before
