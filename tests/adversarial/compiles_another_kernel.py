"""An entry point re-exported by a module whose compile protocol builds a different, honest kernel: a compile gate
that builds whatever the named module offers judges a kernel that never runs."""

from tests.adversarial.candidates import partial_write as reverse_scale  # noqa: F401 - what the contract names
from tests.gates.fixtures.cute_reverse_scale import compile, compile_keys  # noqa: F401 - someone else's kernel
