"""Fused KDA decode step in CuTe DSL (sm_90). Entry point: kernel.kda_decode_cute."""
