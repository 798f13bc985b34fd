"""K3 decode benchmarks at real rank shapes: `bench layer` (one decoder layer of each kind) and `bench step` (the
whole 93-layer schedule), both backends side by side. `layers.py` builds layers, `trace.py` records op calls and
kernel time per op, `run.py` times and checks, `cli.py` is the command line."""
