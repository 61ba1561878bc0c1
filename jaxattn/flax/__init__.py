"""Flax support for jaxattn (needs ``pip install jaxattn[flax]``).

- ``attention_fn``: drop-in ``attention_fn=`` for ``flax.linen.MultiHeadDotProductAttention``
  and ``flax.nnx.MultiHeadAttention``; runs jaxattn's kernels where it can and
  the stock flax function otherwise (warning once per reason, ``FallbackWarning``).
- ``jaxattn.flax.nnx.MultiHeadAttention`` and ``jaxattn.flax.linen.MultiHeadAttention``:
  self-attention layers (GQA, causal, rotary embeddings, logical sharding
  annotations) built on ``jaxattn.flash_attention``; ``layer(x, cache=KVCache...)``
  decodes with a KV cache through ``jaxattn.decode_attention``.
"""

from __future__ import annotations

from . import linen, nnx
from .attention_fn import FallbackWarning, attention_fn
from .kv_cache import KVCache

__all__ = ["attention_fn", "FallbackWarning", "KVCache", "linen", "nnx"]
