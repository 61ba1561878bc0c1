"""Ring attention (context parallelism): attention over a sequence sharded along a mesh axis.

``ring_attention`` runs inside ``jax.shard_map``; ``zigzag_permute`` /
``zigzag_unpermute`` / ``zigzag_indices`` convert to and from the
load-balanced token order of ``layout="zigzag"``. See docs/sharding.md.
"""

from __future__ import annotations

from .layout import zigzag_indices, zigzag_permute, zigzag_unpermute
from .ring_attention import ring_attention

__all__ = ["ring_attention", "zigzag_permute", "zigzag_unpermute", "zigzag_indices"]
