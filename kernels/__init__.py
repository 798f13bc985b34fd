"""Model-independent kernel toolkit: contracts, arch detection, CuTe DSL runtime, timing, roofline."""
