"""Per-kernel resource use read from a cubin (the ELF a CUDA compiler emits), with no CUDA toolkit.

What `ptxas -v` prints, taken from where ptxas records it: the `.nv.info` attributes REGCOUNT and FRAME_SIZE
(per-thread local memory: spills plus local arrays, so an upper bound on spill bytes) keyed by kernel symbol,
and the size of `.nv.shared.<kernel>` (static shared memory). Dynamic shared memory is a launch argument, not
in the cubin: a kernel that requests it adds it to `shared_bytes` itself. A cubin is read directly because the
CuTe DSL emits PTX newer than the ptxas of an older CUDA toolkit accepts.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

EIATTR_FRAME_SIZE = 0x11
EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 0x04  # attribute with a length-prefixed payload; the other formats take 4 bytes in all
SHT_SYMTAB = 2
STT_FUNC = 2


class CubinError(ValueError):
    pass


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    registers: int
    spill_bytes: int  # local memory frame per thread (spills + local arrays)
    shared_bytes: int  # static shared memory per block


@dataclass(frozen=True)
class _Section:
    name: str
    type: int
    offset: int
    size: int
    link: int


def _sections(data: bytes) -> list[_Section]:
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise CubinError("not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = raw[shstrndx][4]
    return [_Section(_cstr(data, names + r[0]), r[1], r[4], r[5], r[6]) for r in raw]


def _cstr(data: bytes, at: int) -> str:
    return data[at:data.index(b"\0", at)].decode()


def _symbols(data: bytes, sections: list[_Section]) -> dict[int, str]:
    symtab = next(s for s in sections if s.type == SHT_SYMTAB)
    strtab = sections[symtab.link].offset
    names = {}
    for i in range(symtab.size // 24):
        st_name, st_info = struct.unpack_from("<IB", data, symtab.offset + 24 * i)
        if st_info & 0xF == STT_FUNC:
            names[i] = _cstr(data, strtab + st_name)
    return names


def _attributes(data: bytes, section: _Section):
    """(attribute, payload) of a .nv.info section."""
    at, end = section.offset, section.offset + section.size
    while at + 4 <= end:
        fmt, attr = data[at], data[at + 1]
        if fmt == EIFMT_SVAL:
            (length,) = struct.unpack_from("<H", data, at + 2)
            yield attr, data[at + 4:at + 4 + length]
            at += 4 + length
        else:
            yield attr, data[at + 2:at + 4]
            at += 4


def kernel_resources(cubin: bytes) -> list[KernelResources]:
    """Registers, local-memory frame and static shared memory of every kernel in `cubin`."""
    sections = _sections(cubin)
    symbols = _symbols(cubin, sections)
    per_symbol: dict[int, dict[int, int]] = {}
    for section in sections:
        if section.name == ".nv.info":
            for attr, payload in _attributes(cubin, section):
                if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and len(payload) == 8:
                    sym, value = struct.unpack("<II", payload)
                    per_symbol.setdefault(sym, {})[attr] = value
    shared = {s.name.removeprefix(".nv.shared."): s.size for s in sections if s.name.startswith(".nv.shared.")}
    kernels = {s.name.removeprefix(".text.") for s in sections if s.name.startswith(".text.")}
    out = []
    for sym, attrs in per_symbol.items():
        name = symbols.get(sym)
        if name in kernels:
            out.append(KernelResources(kernel=name, registers=attrs.get(EIATTR_REGCOUNT, 0),
                                       spill_bytes=attrs.get(EIATTR_FRAME_SIZE, 0), shared_bytes=shared.get(name, 0)))
    if not out:
        raise CubinError("no kernel with a register count in the cubin")
    return sorted(out, key=lambda k: k.kernel)
