"""The gates, one module each defining `GATE`, run in the order gates.core.registry.GATE_MODULES lists them:
contracts, compile, numerics, benchmarks, evals.

Not here: the machinery they run on (gates.core), the op problems they draw inputs from (gates.problems), and
the model-level evals the evals gate runs (gates.evals).
"""
