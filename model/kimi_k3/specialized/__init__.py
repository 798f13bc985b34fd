"""Specialized (contracted) kernels for Kimi K3 decode; each subpackage pairs with contracts/<op>.yaml."""
