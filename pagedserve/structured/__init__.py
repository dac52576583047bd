"""Structured outputs: JSON schema, regex, choice and grammar constraints on generation.

params.py says what a request asks (vLLM's StructuredOutputsParams); grammar.py compiles it with
llguidance (once per distinct constraint) into a per-sequence matcher; bitmask.py turns the
matchers of a batch into a token mask the sampler applies before it picks a token.
"""
from pagedserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
