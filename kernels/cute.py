"""CuTe DSL runtime: importing cutlass for a target, a compile cache, and compile-only resource reports.

- `import_cutlass(default_arch="sm_90a")` imports `cutlass` / `cutlass.cute`. On a machine without a
  GPU it first sets CUTE_DSL_ARCH (the DSL reads it once, at import) so kernels compile for that
  target; on a GPU machine the DSL detects the device itself.
- `dsl_import()` guards a kernel module's DSL imports, so the module stays importable (and says why it
  cannot run) where the DSL is missing or broken; `kernel_available` and `require_dsl` answer from it.
- `CompileCache` maps a key (everything that changes the generated code: shapes baked into the
  kernel, dtypes, tile config, target arch) to a compiled function, in memory and on disk: a process
  loads what another compiled from the same sources (`K3FORGE_COMPILE_CACHE`).
- `compile_for_arch(fn, *args, arch="sm_90a")` compiles a `@cute.jit` function for a target WITHOUT a
  GPU (fake pointers/tensors as arguments) and returns a `CompileReport`: per-kernel registers,
  stack frame, spill stores/loads, static shared memory (parsed from ptxas's own verbose report,
  which the DSL emits as a 'remarks{ptx}' diagnostic), plus the PTX and the path of the kept cubin.

    >>> from kernels.cute import import_cutlass, compile_for_arch
    >>> cutlass, cute = import_cutlass()
    >>> rep = compile_for_arch(my_jit_fn, *fake_args, arch="sm_90a", dynamic_smem_bytes=67584)
    >>> rep.kernels[0].registers, rep.kernels[0].spill_bytes, rep.ok(max_registers=128)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable

from .sources import REPO_ROOT, import_closure, sha256_file

log = logging.getLogger(__name__)


def _gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def cutlass_available() -> tuple[bool, str]:
    """(True, version) when `cutlass` (nvidia-cutlass-dsl) can be imported, else (False, reason)."""
    try:
        cutlass, _ = import_cutlass()
    except Exception as e:  # ImportError, or a broken install (missing compiler libs)
        return False, f"cutlass (nvidia-cutlass-dsl) not importable: {type(e).__name__}: {e}"
    return True, getattr(cutlass, "__version__", "unknown")


def import_cutlass(default_arch: str = "sm_90a"):
    """Import and return (cutlass, cutlass.cute).

    Without a GPU, CUTE_DSL_ARCH is set to `default_arch` first unless it is already set, because the
    DSL reads it once when it is imported. With a GPU nothing is set: the DSL detects the device.
    """
    if "cutlass" not in __import__("sys").modules and not os.environ.get("CUTE_DSL_ARCH") and not _gpu_present():
        os.environ["CUTE_DSL_ARCH"] = default_arch
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


def current_cute_arch() -> str:
    """The target the DSL compiles for in this process ('sm_90a', ...)."""
    if os.environ.get("CUTE_DSL_ARCH"):
        return os.environ["CUTE_DSL_ARCH"]
    from .arch import detect

    info = detect()
    return info.cute_arch or "sm_90a"


class DslImport:
    """What `dsl_import()` leaves: `error` is None when every import in the block succeeded, else why not."""

    error: str | None = None


@contextlib.contextmanager
def dsl_import():
    """Guard a kernel module's DSL imports; the module stays importable without the DSL, and says why it cannot
    run:

        with dsl_import() as DSL:
            cutlass, cute = import_cutlass()
            from cutlass import Float32
        if DSL.error is None:
            class MyKernel: ...   # code that needs the DSL at import time
    """
    status = DslImport()
    try:
        yield status
    except Exception as e:  # cutlass not installed, or a broken install (missing compiler libraries)
        status.error = f"{type(e).__name__}: {e}"


def kernel_available(import_error: str | None, major: int = 9) -> tuple[bool, str]:
    """(True, 'ok') where a kernel built for sm_{major}0a can run: the DSL imported and such a GPU is present."""
    if import_error is not None:
        return False, f"CuTe DSL unavailable: {import_error}"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    found, _ = torch.cuda.get_device_capability()
    if found != major:
        return False, f"built for sm_{major}0a only (this device is sm_{found}x)"
    return True, "ok"


def require_dsl(import_error: str | None) -> None:
    """Raise where a kernel module's DSL imports failed (before compiling or launching)."""
    if import_error is not None:
        raise RuntimeError(f"CuTe DSL unavailable: {import_error}")


CACHE_ENV = "K3FORGE_COMPILE_CACHE"  # a directory, or "off"; unset: ~/.cache/k3forge/cute


def compile_cache_dir() -> Path | None:
    """Where compiled kernels persist between processes, or None when the on-disk cache is off."""
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "k3forge" / "cute"


class CompileCache:
    """Thread-safe map from a hashable key to a compiled function; `get(key, build)` compiles once.

    The key must hold exactly what changes the generated code (baked-in shapes, dtypes, tile config,
    target arch); runtime values (pointers, batch size, scalars passed as arguments) must not be in it.

    Compiled functions also persist on disk (`compile_cache_dir()`), as the object files the DSL exports, named
    by a digest of the cache's name, repr(key), the DSL version and the sha256 of every repository file that
    `module` imports (read statically, as evidence freshness reads them): edit the kernel or anything it
    imports and the entry no longer matches. A file that fails to load is compiled again and replaced. The gate
    points every run at an empty directory of its own, so nothing compiled outside the run is loaded into it.
    """

    def __init__(self, name: str, module: str | None = None):
        self.name = name
        self.module = module  # the dotted kernel module whose source (and imports) generate the code
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self._sources: str | None = None
        self.misses = 0  # compiled here
        self.hits = 0  # found in memory
        self.loads = 0  # loaded from disk

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._entries:
                self.hits += 1
                return self._entries[key]
        compiled = self._load(key)
        if compiled is None:
            compiled = build()
            self._store(key, compiled)
            counter = "misses"
        else:
            counter = "loads"
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
            return self._entries.setdefault(key, compiled)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def path(self, key: Hashable) -> Path | None:
        """The object file `key` persists in, or None without an on-disk cache (off, or no module named)."""
        directory = compile_cache_dir()
        if directory is None or self.module is None:
            return None
        if self._sources is None:
            files = import_closure([self.module])
            self._sources = "".join(f"{f.relative_to(REPO_ROOT).as_posix()}\0{sha256_file(f)}\n" for f in files)
        cutlass, _ = import_cutlass()
        text = f"{self.name}\0{key!r}\0{getattr(cutlass, '__version__', '')}\0{self._sources}"
        return directory / f"{self.name}-{hashlib.sha256(text.encode()).hexdigest()[:40]}.o"

    def _load(self, key: Hashable) -> Any:
        path = self.path(key)
        if path is None or not path.is_file():
            return None
        try:
            _, cute = import_cutlass()
            return getattr(cute.runtime.load_module(str(path)), _SYMBOL)
        except Exception as e:  # a truncated or foreign file: compile again, and replace it
            log.warning("compile cache: %s did not load (%s: %s); compiling again", path, type(e).__name__, e)
            return None

    def _store(self, key: Hashable, compiled: Any) -> None:
        path = self.path(key)
        if path is None or not hasattr(compiled, "export_to_c"):
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as tmp:
                compiled.export_to_c(tmp, _SYMBOL)
                os.replace(os.path.join(tmp, f"{_SYMBOL}.o"), path)  # atomic: readers see all of it or none
        except Exception as e:  # a read-only or full disk costs a recompile next time, nothing else
            log.warning("compile cache: could not write %s (%s: %s)", path, type(e).__name__, e)


_SYMBOL = "kernel"  # the symbol prefix every exported object file uses (one function per file)


@dataclass(frozen=True)
class KernelResources:
    """ptxas's report for one kernel (entry function)."""

    name: str
    arch: str
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    static_smem_bytes: int
    barriers: int | None = None
    dynamic_smem_bytes: int | None = None  # declared by the kernel author (the DSL allocates it at launch)

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    @property
    def smem_bytes(self) -> int:
        return self.static_smem_bytes + (self.dynamic_smem_bytes or 0)


@dataclass
class CompileReport:
    arch: str
    kernels: list[KernelResources]
    compiled: Any = None
    ptx: str | None = None
    cubin_path: str | None = None
    ptx_path: str | None = None
    ptxas_log: str = ""
    notes: list[str] = field(default_factory=list)

    def ok(self, max_registers: int | None = None, max_spill_bytes: int = 0,
           max_smem_bytes: int | None = None) -> bool:
        """True when every kernel fits the limits (spills default to none allowed)."""
        if not self.kernels:
            return False
        for k in self.kernels:
            if max_registers is not None and k.registers > max_registers:
                return False
            if k.spill_bytes > max_spill_bytes or k.stack_frame_bytes > max_spill_bytes:
                return False
            if max_smem_bytes is not None and k.smem_bytes > max_smem_bytes:
                return False
        return True

    def as_dict(self) -> dict:
        return dict(arch=self.arch, cubin_path=self.cubin_path, ptx_path=self.ptx_path, notes=self.notes,
                    kernels=[dict(k.__dict__, spill_bytes=k.spill_bytes, smem_bytes=k.smem_bytes)
                             for k in self.kernels])


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_ENTRY_RE = re.compile(r"Compiling\s+entry\s+function\s+'([^']+)'\s+for\s+'([^']+)'")
_FRAME_RE = re.compile(r"(\d+)\s+bytes\s+stack\s+frame,\s+(\d+)\s+bytes\s+spill\s+stores,"
                       r"\s+(\d+)\s+bytes\s+spill\s+loads")
_REGS_RE = re.compile(r"Used\s+(\d+)\s+registers(?:,\s+used\s+(\d+)\s+barriers)?")
_SMEM_RE = re.compile(r"(\d+)\s+bytes\s+smem")


def parse_ptxas_log(text: str, dynamic_smem_bytes: int | None = None) -> list[KernelResources]:
    """Parse `ptxas -v` output (one block per entry function) into KernelResources.

    Tolerates the DSL's rendering of the log (ANSI colours, re-wrapped and indented lines). A kernel
    reported twice (a plain log and a spill remark carrying the same log) is kept once.
    """
    text = _ANSI_RE.sub("", text)
    kernels: dict[str, KernelResources] = {}
    starts = [m.start() for m in _ENTRY_RE.finditer(text)]
    for i, start in enumerate(starts):
        block = text[start:starts[i + 1] if i + 1 < len(starts) else len(text)]
        m = _ENTRY_RE.search(block)
        frame = _FRAME_RE.search(block)
        regs = _REGS_RE.search(block)
        smem = _SMEM_RE.search(block)
        kernels[m.group(1)] = KernelResources(
            name=m.group(1), arch=m.group(2),
            registers=int(regs.group(1)) if regs else -1,
            barriers=int(regs.group(2)) if regs and regs.group(2) else None,
            stack_frame_bytes=int(frame.group(1)) if frame else 0,
            spill_store_bytes=int(frame.group(2)) if frame else 0,
            spill_load_bytes=int(frame.group(3)) if frame else 0,
            static_smem_bytes=int(smem.group(1)) if smem else 0,
            dynamic_smem_bytes=dynamic_smem_bytes,
        )
    return list(kernels.values())


class _Tee(io.TextIOBase):
    """Write-through capture of a text stream."""

    def __init__(self, inner, echo: bool):
        self.inner, self.echo, self.buf = inner, echo, io.StringIO()

    def write(self, s):
        self.buf.write(s)
        if self.echo:
            self.inner.write(s)
        return len(s)

    def flush(self):
        if self.echo:
            self.inner.flush()


def compile_for_arch(fn: Callable, *args, arch: str = "sm_90a", options: str = "", dump_dir: str | None = None,
                     dynamic_smem_bytes: int | None = None, echo: bool = False, **kwargs) -> CompileReport:
    """Compile a `@cute.jit` function (or callable object) for `arch` and report kernel resources.

    Works without a GPU: pass fake arguments (`cute.runtime.make_ptr(dtype, 0, ...)`,
    `make_fake_compact_tensor`, `cuda.CUstream(0)`). The PTX and cubin are kept under `dump_dir` (a
    fresh temporary directory by default). `dynamic_smem_bytes` is what the kernel allocates through
    the DSL's SmemAllocator (ptxas only sees static shared memory); it is copied into the report.
    """
    import sys

    _, cute = import_cutlass(default_arch=arch)
    dump_dir = dump_dir or tempfile.mkdtemp(prefix="cute_compile_")
    os.makedirs(dump_dir, exist_ok=True)
    opts = f"--gpu-arch={arch} --keep-ptx --keep-cubin --dump-dir={dump_dir} remarks{{ptx}} {options}".strip()
    tee = _Tee(sys.stderr, echo)
    with contextlib.redirect_stderr(tee):
        compiled = cute.compile(fn, *args, options=opts, **kwargs)
    log = tee.buf.getvalue()
    ptx = getattr(compiled, "__ptx__", None)
    ptx_files = sorted(f for f in os.listdir(dump_dir) if f.endswith(".ptx"))
    cubins = sorted(f for f in os.listdir(dump_dir) if f.endswith(".cubin"))
    report = CompileReport(arch=arch, kernels=parse_ptxas_log(log, dynamic_smem_bytes), compiled=compiled,
                           ptx=ptx if isinstance(ptx, str) and ptx.lstrip().startswith("//") else None,
                           cubin_path=os.path.join(dump_dir, cubins[-1]) if cubins else None,
                           ptx_path=os.path.join(dump_dir, ptx_files[-1]) if ptx_files else None,
                           ptxas_log=log)
    if report.ptx is None and report.ptx_path:
        with open(report.ptx_path) as f:
            report.ptx = f.read()
    if not report.kernels:
        report.notes.append("no ptxas report captured (the DSL may have served the kernel from its cache)")
    return report


def ptx_instruction_counts(ptx: str, patterns: dict[str, str] | None = None) -> dict[str, int]:
    """Count PTX instructions by regex, e.g. {'ld.global.v4': r'ld\\.global(\\.\\w+)*\\.v4'}."""
    patterns = patterns or {
        "ld.global.v4": r"\bld\.global(?:\.[\w:]+)*\.v4\b",
        "st.global.v4": r"\bst\.global(?:\.[\w:]+)*\.v4\b",
        "cp.async": r"\bcp\.async\.c[ag]\b",
        "ld.local": r"\bld\.local\b",
        "st.local": r"\bst\.local\b",
        "shfl": r"\bshfl\.sync\b",
        "bar.sync": r"\bbar(?:rier)?\.sync\b",
    }
    return {k: len(re.findall(v, ptx)) for k, v in patterns.items()}
