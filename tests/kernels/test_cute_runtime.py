"""kernels.cute: compile cache keying, ptxas report parsing, compile-only resource report on CPU."""

import threading

import pytest

from kernels.cute import CompileCache, CompileReport, KernelResources, cutlass_available, parse_ptxas_log

CUTLASS_OK, CUTLASS_WHY = cutlass_available()

PLAIN = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kern_a' for 'sm_90a'
ptxas info    : Function properties for kern_a
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compile time = 16.140 ms
"""

WRAPPED = """\x1b[96mremark:\x1b[0m Spilled values ...
          ptxas output:
          ptxas info    : Compiling entry function
          'kern_b'
          for 'sm_90a'
          ptxas info    : Function properties for
          kern_b
          ptxas         .     112 bytes stack frame, 108 bytes spill stores, 108 bytes spill loads
          ptxas info    : Used 80 registers, used 1 barriers, 112 bytes cumulative stack size
"""


def test_parse_plain_and_wrapped_logs():
    (a,) = parse_ptxas_log(PLAIN, dynamic_smem_bytes=4096)
    assert (a.name, a.arch, a.registers, a.barriers) == ("kern_a", "sm_90a", 64, 1)
    assert a.spill_bytes == 0 and a.static_smem_bytes == 1024 and a.smem_bytes == 1024 + 4096
    (b,) = parse_ptxas_log(WRAPPED)
    assert ((b.name, b.registers, b.stack_frame_bytes, b.spill_store_bytes, b.spill_load_bytes)
            == ("kern_b", 80, 112, 108, 108))
    both = parse_ptxas_log(PLAIN + WRAPPED)
    assert [k.name for k in both] == ["kern_a", "kern_b"]


def test_report_limits():
    k = KernelResources("k", "sm_90a", 64, 0, 0, 0, 0, dynamic_smem_bytes=70000)
    rep = CompileReport("sm_90a", [k])
    assert rep.ok(max_registers=128, max_smem_bytes=227 * 1024)
    assert not rep.ok(max_registers=32)
    assert not rep.ok(max_smem_bytes=65536)
    spilled = CompileReport("sm_90a", [KernelResources("k", "sm_90a", 80, 112, 108, 108, 0)])
    assert not spilled.ok()
    assert not CompileReport("sm_90a", []).ok()


def test_compile_cache_builds_once_per_key():
    cache = CompileCache("t")
    builds = []

    def build(tag):
        builds.append(tag)
        return object()

    a1 = cache.get(("k", 12, "sm_90a"), lambda: build(1))
    a2 = cache.get(("k", 12, "sm_90a"), lambda: build(2))
    b = cache.get(("k", 96, "sm_90a"), lambda: build(3))
    assert a1 is a2 and a1 is not b and builds == [1, 3] and len(cache) == 2
    assert cache.hits == 1 and cache.misses == 2


def test_compile_cache_threads():
    cache = CompileCache("t")
    out = []
    ts = [threading.Thread(target=lambda: out.append(cache.get("x", object))) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert len({id(o) for o in out}) == 1


LINEAR_KERNEL = "model.kimi_k3.specialized.linear.kernel"


def _linear_build(builds: list):
    from model.kimi_k3.specialized.linear.kernel import LinearConfig, compile_kernel

    def build():
        builds.append(1)
        return compile_kernel(LinearConfig.for_shape(1, 256, 256), 1, 256)

    return build


def test_compile_cache_path_names_what_generates_the_code(tmp_path, monkeypatch):
    pytest.importorskip("cutlass", reason=CUTLASS_WHY)
    monkeypatch.setenv("K3FORGE_COMPILE_CACHE", str(tmp_path))
    cache = CompileCache("linear", module=LINEAR_KERNEL)
    a, b = cache.path(("k", 1, "sm_90a")), cache.path(("k", 2, "sm_90a"))
    assert a.parent == tmp_path and a != b
    assert a == CompileCache("linear", module=LINEAR_KERNEL).path(("k", 1, "sm_90a"))  # another process's name
    assert CompileCache("other", module=LINEAR_KERNEL).path(("k", 1, "sm_90a")) != a  # the name is in the digest
    assert CompileCache("linear").path(("k", 1, "sm_90a")) is None  # no module: nothing to hash, memory only
    monkeypatch.setenv("K3FORGE_COMPILE_CACHE", "off")
    assert cache.path(("k", 1, "sm_90a")) is None


def test_compile_cache_sources_cover_the_kernel_and_its_imports(tmp_path, monkeypatch):
    pytest.importorskip("cutlass", reason=CUTLASS_WHY)
    monkeypatch.setenv("K3FORGE_COMPILE_CACHE", str(tmp_path))
    cache = CompileCache("linear", module=LINEAR_KERNEL)
    cache.path("k")
    for name in ("model/kimi_k3/specialized/linear/kernel.py", "kernels/cute.py"):
        assert f"{name}\0" in cache._sources, name  # edit either and every entry stops matching


@pytest.mark.skipif(not CUTLASS_OK, reason=f"CuTe DSL not importable: {CUTLASS_WHY}")
def test_compile_cache_persists_between_processes(tmp_path, monkeypatch):
    """A second cache (another process's) loads what the first compiled instead of compiling it; a damaged file
    is compiled again and replaced."""
    monkeypatch.setenv("K3FORGE_COMPILE_CACHE", str(tmp_path))
    builds: list = []
    first = CompileCache("linear", module=LINEAR_KERNEL)
    first.get(("tiny", "sm_90a"), _linear_build(builds))
    assert builds == [1] and first.misses == 1 and len(list(tmp_path.glob("linear-*.o"))) == 1
    second = CompileCache("linear", module=LINEAR_KERNEL)
    loaded = second.get(("tiny", "sm_90a"), _linear_build(builds))
    assert builds == [1] and second.loads == 1 and second.misses == 0 and callable(loaded)
    (path,) = tmp_path.glob("linear-*.o")
    path.write_bytes(b"not an object file")
    third = CompileCache("linear", module=LINEAR_KERNEL)
    third.get(("tiny", "sm_90a"), _linear_build(builds))
    assert builds == [1, 1] and third.misses == 1 and path.read_bytes() != b"not an object file"


@pytest.mark.gpu
@pytest.mark.skipif(not CUTLASS_OK, reason=f"CuTe DSL not importable: {CUTLASS_WHY}")
def test_a_loaded_kernel_computes_what_the_compiled_one_does(tmp_path, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (H200)")
    from model.kimi_k3.specialized import linear

    monkeypatch.setenv("K3FORGE_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr(linear, "_CACHE", CompileCache("linear", module=LINEAR_KERNEL))
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    compiled = linear.linear_cute(x, w)
    monkeypatch.setattr(linear, "_CACHE", CompileCache("linear", module=LINEAR_KERNEL))
    loaded = linear.linear_cute(x, w)
    assert linear._CACHE.loads == 1 and linear._CACHE.misses == 0
    assert torch.equal(compiled, loaded)


def test_kernel_config_is_the_cache_key():
    pytest.importorskip("cutlass", reason=CUTLASS_WHY)
    from model.kimi_k3.specialized.kda_decode.kernel import KDADecodeConfig

    keys = {KDADecodeConfig(heads=h) for h in (6, 12, 12, 96)}
    assert len(keys) == 3
    assert KDADecodeConfig(heads=12, slot_dtype="int64") != KDADecodeConfig(heads=12)


@pytest.mark.skipif(not CUTLASS_OK, reason=f"CuTe DSL not importable: {CUTLASS_WHY}")
def test_compile_for_arch_tiny_kernel_without_gpu(tmp_path):
    from kernels.cute import compile_for_arch, import_cutlass, ptx_instruction_counts

    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_ptr

    @cute.kernel
    def scale_kernel(p: cute.Pointer, n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        m = cute.make_tensor(p, cute.make_layout((n,)))
        i = bidx * 128 + tidx
        if i < n:
            m[i] = m[i] * Float32(2.0)

    @cute.jit
    def scale(p: cute.Pointer, n: Int32, stream: cuda.CUstream):
        scale_kernel(p, n).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)

    rep = compile_for_arch(scale, make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=4), Int32(1),
                           cuda.CUstream(0), arch="sm_90a", dump_dir=str(tmp_path))
    assert len(rep.kernels) == 1
    k = rep.kernels[0]
    assert k.arch == "sm_90a" and 0 < k.registers <= 32 and k.spill_bytes == 0
    assert rep.ok(max_registers=64)
    assert rep.ptx and ".target sm_90a" in rep.ptx
    assert rep.cubin_path and rep.cubin_path.startswith(str(tmp_path))
    assert ptx_instruction_counts(rep.ptx)["ld.local"] == 0
