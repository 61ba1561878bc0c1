"""Flax support for jaxattn (needs ``pip install jaxattn[flax]``).

- ``attention_fn``: drop-in ``attention_fn=`` for ``flax.linen.MultiHeadDotProductAttention``
  and ``flax.nnx.MultiHeadAttention``; runs jaxattn's kernels where it can and
  the stock flax function otherwise (warning once per reason, ``FallbackWarning``).
- ``jaxattn.flax.nnx.MultiHeadAttention`` and ``jaxattn.flax.linen.MultiHeadAttention``:
  self-attention layers (GQA, causal, rotary embeddings, logical sharding
  annotations) built on ``jaxattn.flash_attention``.
"""

from __future__ import annotations

from . import linen, nnx
from .attention_fn import FallbackWarning, attention_fn

__all__ = ["attention_fn", "FallbackWarning", "linen", "nnx"]
