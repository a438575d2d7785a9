"""kvbackend: a token-exact, tiered prefix KV-cache backend for vLLM and SGLang."""

__version__ = "0.1.0"
