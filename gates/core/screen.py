"""A static screen of candidate code: the implementation's module and every repository module it imports (followed
statically, gates.core.sources.import_closure), the gate's own package excepted, read with `ast` for what a kernel
has no business doing. Nothing is executed.

No black-box test can tell a kernel that behaves only while it is judged, or one that rewrites its judge, from an
honest one; the screen reads the code for the means. Each finding is listed in the report for the reviewer. The
ones that can only be cheating fail the contracts gate, before any candidate call:
- assigning (or setattr/delattr) to an attribute of a gate module, of a function the harness times or checks
  with (gates.core.worker.GUARDED) or of a class or module it checks every tensor with (`torch.Tensor`,
  gates.core.worker.LIBRARY_SURFACE), rewriting a function's code, or editing `sys.modules`;
- walking frames into callers (`sys._getframe`, `f_back`, `f_globals`, `inspect.stack`, ...) or reaching other
  objects through the garbage collector (`gc.get_objects`, `gc.get_referrers`);
- naming the gate harness in a string (`"gates.core.worker" in sys.modules`, the child's process name, the
  production replay's module), or importing the production replay;
- writing, moving or deleting a file named from `__file__` or a repository path.
The rest is listed for review, never failed: other monkeypatching, reading `sys.modules`, `gc`, `inspect`,
environment and process inspection (`os.environ`, `sys.argv`, `psutil`, `/proc`), dynamic imports
(`importlib`, `__import__`), code built at run time (`exec`, `eval`), file writes elsewhere, starting a thread
or a process (work that can run while the gate times the standard, or outside the timed stream), and asking
whether the call is being captured into a CUDA graph (`torch.cuda.is_current_stream_capturing`), and asking the L2
to keep lines across calls (a persisting set-aside or access policy window, evict_last hints: data kept there
outlives the benchmarks' flush). Kernels legitimately read an environment variable or a tuned config, or hint that
data reused within one call stay; a reviewer judges those.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from gates.core.sources import REPO_ROOT, import_closure, module_file, relative
from gates.core.worker import GUARDED, LIBRARY_SURFACE  # what the worker captures, and what it checks tensors with

HARNESS_PACKAGE = "gates"
FRAME_ATTRS = frozenset({"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame", "gi_frame", "cr_frame"})
CODE_ATTRS = frozenset({"__code__", "__globals__", "__closure__", "__defaults__", "__kwdefaults__"})
FRAME_CALLS = frozenset({"sys._getframe", "inspect.currentframe", "inspect.stack", "inspect.getouterframes",
                         "inspect.trace", "traceback.extract_stack", "traceback.walk_stack"})
GC_REACH = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
ENV_CALLS = frozenset({"os.getenv", "os.getpid", "os.getppid", "os.getcwd", "multiprocessing.current_process",
                       "multiprocessing.parent_process", "threading.current_thread", "socket.gethostname"})
ENV_ATTRS = frozenset({"os.environ", "sys.argv", "sys.orig_argv", "sys.modules"})
DYNAMIC = frozenset({"importlib.import_module", "importlib.reload", "importlib.util.spec_from_file_location",
                     "importlib.util.module_from_spec", "__import__", "exec", "eval", "compile", "runpy.run_path",
                     "runpy.run_module"})
REVIEWED_IMPORTS = {"gc": "introspection", "inspect": "introspection", "ctypes": "introspection",
                    "psutil": "environment", "importlib": "dynamic_import", "runpy": "dynamic_import",
                    "subprocess": "environment"}
WRITE_CALLS = frozenset({"os.remove", "os.unlink", "os.rename", "os.replace", "os.rmdir", "os.removedirs",
                         "os.makedirs", "os.mkdir", "os.utime", "os.chmod", "os.truncate", "os.symlink", "os.link",
                         "shutil.rmtree", "shutil.move", "shutil.copy", "shutil.copy2", "shutil.copyfile",
                         "shutil.copytree", "py_compile.compile", "marshal.dump"})
CONCURRENCY_CALLS = frozenset({"threading.Thread", "threading.Timer", "_thread.start_new_thread",
                               "_thread.start_new", "concurrent.futures.ThreadPoolExecutor",
                               "concurrent.futures.ProcessPoolExecutor", "multiprocessing.Process",
                               "multiprocessing.Pool", "multiprocessing.get_context", "os.fork", "os.forkpty",
                               "os.system", "os.popen", "os.posix_spawn", "os.posix_spawnp", "subprocess.Popen",
                               "subprocess.run", "subprocess.call", "subprocess.check_call", "subprocess.check_output"})
# Whether the call is being captured into a CUDA graph: a kernel may ask (to skip a host sync it cannot make under
# capture), but then it can also compute differently there, and serving and the benchmarks replay graphs while the
# numerics call it eagerly. The benchmarks re-check what the replays computed; the reviewer reads why it asks.
CAPTURE_CALLS = frozenset({"torch.cuda.is_current_stream_capturing", "torch.cuda.graphs.is_current_stream_capturing",
                           "torch.cuda.graph.is_current_stream_capturing", "torch.compiler.is_compiling",
                           "torch._dynamo.is_compiling"})
WRITE_METHODS = frozenset({"write_text", "write_bytes", "unlink", "touch", "rmdir", "symlink_to", "hardlink_to"})
REPO_PATH = re.compile(r"(^|/)(gates|contracts|evidence|kernels|model|tests|agent_tasks)/|__pycache__|\.pyc$")
REPLAY_MODULE = "model.kimi_k3.replay"  # the numerics gate's production replay: only the gate runs it
HARNESS_NAME = re.compile(r"^gates\.\w+(\.\w+)*$|k3forge-candidate|kimi_k3\.replay\b")
# Keeping lines in the L2 across calls: the set-aside for persisting accesses and the access policy windows that use it
# (CUDA runtime and driver names), eviction-priority hints (PTX `L2::evict_last`, the CuTe DSL's and Triton's
# spellings of it), and the device-wide limits they are set with.
L2_RESIDENCY = re.compile(r"persisting_?l2|access_?policy_?window|evict_?last|(cuda_?device|cu_?ctx)_?set_?limit",
                          re.IGNORECASE)


@dataclass(frozen=True)
class Finding:
    rule: str  # monkeypatch, frames, introspection, environment, dynamic_import, file_write, harness, concurrency,
    # capture, l2_residency
    cheat: bool  # can only be cheating: fails the gate
    where: str  # path:line
    what: str

    def line(self) -> str:
        return f"{self.where}: {self.what}"


def _package(path: Path, root: Path) -> list[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts if path.name == "__init__.py" else parts[:-1]


class _Reader(ast.NodeVisitor):
    """One module's findings. Names bound by imports are followed through attribute chains, so `torch.cuda.Event
    .elapsed_time = f` reads as an assignment to that dotted name; anything else (locals, self) is not a module."""

    def __init__(self, path: Path, root: Path):
        self.path, self.rel, self.package = path, relative(path, root), _package(path, root)
        self.bound: dict[str, str] = {}
        self.findings: list[Finding] = []
        self.docstrings: set[int] = set()
        self.repo_paths: set[str] = set()  # names assigned a path built from __file__ or a repository directory

    def add(self, node: ast.AST, rule: str, cheat: bool, what: str) -> None:
        self.findings.append(Finding(rule, cheat, f"{self.rel}:{getattr(node, 'lineno', 0)}", what))

    # ---- names
    def dotted(self, node: ast.AST) -> str | None:
        """The dotted name an expression refers to through import bindings, or None."""
        if isinstance(node, ast.Name):
            if node.id in self.bound:
                return self.bound[node.id]
            return node.id if node.id in ("__import__", "exec", "eval", "compile", "open", "setattr",
                                          "delattr") else None
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package[: len(self.package) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.split(".")[0]
            self.bound[alias.asname or top] = alias.name if alias.asname else top
            self._imported(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = self._absolute(node)
        for alias in node.names:
            if alias.name != "*":
                self.bound[alias.asname or alias.name] = f"{module}.{alias.name}"
        replay = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" == REPLAY_MODULE]
        self._imported(node, replay[0] if replay else module)  # `from model.kimi_k3 import replay` names it too

    def _imported(self, node: ast.AST, module: str) -> None:
        top = module.split(".")[0]
        if module == REPLAY_MODULE:
            self.add(node, "harness", True, f"imports {module}, the gate's production replay, which serving never "
                     "loads: code that knows it can be right only where it is replayed")
        elif top == HARNESS_PACKAGE:
            self.add(node, "harness", False, f"imports the gate's own code ({module}); the kernel runs in serving "
                     "without it")
        elif top in REVIEWED_IMPORTS:
            self.add(node, REVIEWED_IMPORTS[top], False, f"imports {module}")

    # ---- writes to other modules' attributes
    def _assigned(self, node: ast.AST, target: ast.AST, verb: str) -> None:
        if isinstance(target, ast.Subscript) and self.dotted(target.value) == "sys.modules":
            self.add(node, "monkeypatch", True, f"{verb} an entry of sys.modules (what every later import gets)")
        if not isinstance(target, ast.Attribute):
            return
        if target.attr == "__code__":
            self.add(node, "monkeypatch", True, f"{verb} a function's __code__ (its behaviour, under its own name)")
            return
        name = self.dotted(target)
        if name is not None:
            self._patched(node, name, verb)

    def _patched(self, node: ast.AST, name: str, verb: str) -> None:
        if name.split(".")[0] == HARNESS_PACKAGE or name in GUARDED or name.rpartition(".")[0] in LIBRARY_SURFACE:
            self.add(node, "monkeypatch", True, f"{verb} {name}, which the gate judges or times with")
        else:
            self.add(node, "monkeypatch", False, f"{verb} {name}, an attribute of another module")

    def _names_repo_path(self, node: ast.AST) -> bool:
        return any((isinstance(n, ast.Name) and (n.id == "__file__" or n.id in self.repo_paths))
                   or (isinstance(n, ast.Constant) and isinstance(n.value, str) and REPO_PATH.search(n.value))
                   for n in ast.walk(node))

    def visit_Assign(self, node: ast.Assign) -> None:
        if self._names_repo_path(node.value):
            self.repo_paths.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for target in node.targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                self._assigned(node, t, "assigns")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._assigned(node, node.target, "updates")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._assigned(node, node.target, "assigns")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._assigned(node, target, "deletes")
        self.generic_visit(node)

    # ---- calls
    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        method = node.func.attr if isinstance(node.func, ast.Attribute) else None
        if name in ("setattr", "delattr") and node.args:
            target = self.dotted(node.args[0])
            attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
            if target is not None:
                self._patched(node, f"{target}.{attr}", f"{name}s")
        elif name in FRAME_CALLS:
            self.add(node, "frames", True, f"calls {name}: reads the frames of whoever called it")
        elif name in GC_REACH:
            self.add(node, "introspection", True, f"calls {name}: reaches objects it was never given")
        elif name in ENV_CALLS or (name or "").startswith("psutil."):
            self.add(node, "environment", False, f"calls {name}: inspects its process or environment")
        elif name in DYNAMIC:
            self.add(node, "dynamic_import", False, f"calls {name}: code chosen at run time")
        elif name in CAPTURE_CALLS:
            self.add(node, "capture", False, f"calls {name}: can compute differently when captured into a CUDA "
                     "graph (serving and the benchmarks replay graphs; the numerics call it eagerly)")
        elif name in CONCURRENCY_CALLS:
            self.add(node, "concurrency", False, f"calls {name}: work that runs beside the call, where the gate "
                     "times the standard or outside the timed stream")
        elif name in ("sys.modules.pop", "sys.modules.update", "sys.modules.setdefault", "sys.modules.clear"):
            self.add(node, "monkeypatch", True, f"calls {name} (what every later import gets)")
        elif name in ("open", "io.open", "os.open") and self._opens_for_writing(node):
            self._writes(node, name)
        elif name in WRITE_CALLS or (name is None and method in WRITE_METHODS):
            self._writes(node, name or f".{method}()")
        self.generic_visit(node)

    @staticmethod
    def _opens_for_writing(node: ast.Call) -> bool:
        mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg in ("mode",
                                                                                                      "flags")), None)
        if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
            return any(c in mode.value for c in "wax+")
        return mode is not None  # a computed mode (or os.open flags): may write

    def _writes(self, node: ast.Call, name: str) -> None:
        if self._names_repo_path(node):
            self.add(node, "file_write", True, f"{name}: writes into the repository (a path from __file__ or the "
                     "tree's own directories): the gate's code, contracts or evidence are not a kernel's to change")
        else:
            self.add(node, "file_write", False, f"{name}: writes, moves or deletes a file")

    # ---- attribute reads and strings
    def _l2_residency(self, node: ast.AST, name: str) -> None:
        where = f"{self.rel}:{getattr(node, 'lineno', 0)}"
        if any(f.rule == "l2_residency" and f.where == where for f in self.findings):
            return  # one finding a line
        self.add(node, "l2_residency", False, f"names {name}: a means to keep lines in the L2 across calls, where a "
                 "decode step's other layers would have evicted them (the benchmarks release any set-aside before "
                 "timing and fail a candidate that made one)")

    def visit_Name(self, node: ast.Name) -> None:
        if L2_RESIDENCY.search(node.id):
            self._l2_residency(node, node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if L2_RESIDENCY.search(node.attr):
            self._l2_residency(node, node.attr)
        if node.attr in FRAME_ATTRS:
            self.add(node, "frames", True, f"reads .{node.attr}: walks into frames it was not given")
        elif node.attr in CODE_ATTRS and isinstance(node.ctx, ast.Load):
            self.add(node, "introspection", False, f"reads .{node.attr} of a function")
        elif isinstance(node.ctx, ast.Load) and (name := self.dotted(node)) in ENV_ATTRS:
            self.add(node, "environment", False, f"reads {name}: inspects its process or what it was imported with")
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant):
            self.docstrings.add(id(node.value))  # a docstring or a bare string statement says, it does not test
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if id(node) in self.docstrings or not isinstance(node.value, str):
            return
        if HARNESS_NAME.search(node.value):
            self.add(node, "harness", True, f"names the gate harness ({node.value!r}): code that looks for the "
                     "judge can behave differently while judged")
        elif node.value.startswith("/proc"):
            self.add(node, "environment", False, f"names {node.value!r}: inspects processes")
        elif L2_RESIDENCY.search(node.value):
            self._l2_residency(node, repr(node.value))


def screen_file(path: Path, root: Path = REPO_ROOT) -> list[Finding]:
    reader = _Reader(path, root)
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:  # importing it fails too: the contract check says so
        return [Finding("unreadable", False, f"{relative(path, root)}:0", f"not Python the screen can read ({e})")]
    reader.visit(tree)
    return reader.findings


def screened_files(entry: str, root: Path = REPO_ROOT) -> list[Path]:
    """The entry point's module and the repository modules it imports, without the gate's own package."""
    module = entry.partition(":")[0]
    files = import_closure([module], root)
    own = module_file(module, root)
    return [p for p in files if p == own or p.relative_to(root).parts[0] != HARNESS_PACKAGE]


def screen(entry: str, root: Path = REPO_ROOT) -> list[Finding]:
    """Every finding in the code an entry point (`module:function`) runs, file by file in path order."""
    return [f for path in screened_files(entry, root) for f in screen_file(path, root)]
