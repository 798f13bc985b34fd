"""The gates, one module each, run in the order gates.registry.GATE_MODULES lists them."""
