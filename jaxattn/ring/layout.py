"""Token orders of ring attention and the sub-blocks each ring step computes.

A sequence of length ``T`` sharded over ``P`` devices along a mesh axis:

* ``"contiguous"``: device ``d`` holds tokens ``[d*T/P, (d+1)*T/P)`` (what
  ``PartitionSpec(None, axis)`` gives for the array in its natural order).
  Causal attention is unbalanced: device ``d`` has ``d + 1`` key/value blocks
  to attend, device ``0`` only its own.
* ``"zigzag"``: the sequence is cut into ``2P`` chunks of ``c = T/(2P)``
  tokens and device ``d`` holds chunks ``d`` and ``2P-1-d``, in that order
  (for ``P = 4``: chunks ``0 7 | 1 6 | 2 5 | 3 4``). Every device then does
  the same causal work at every ring step. ``zigzag_permute`` puts a
  naturally ordered array into this order (so that contiguous sharding hands
  each device its two chunks) and ``zigzag_unpermute`` undoes it.

At ring step ``s`` device ``r`` holds the key/value block of device
``(r - s) mod P``: its own at step 0, then one that precedes its own in the
sequence (``"earlier"``) exactly when ``s <= r``, else one that follows it
(``"later"``). ``step_blocks`` lists, for each of these cases, the kernel calls that cover exactly the visible (query, key)
pairs: whole sub-blocks with no mask, or a diagonal one with the kernel's
causal mask; invisible sub-blocks are skipped.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Block:
    """One kernel call of a ring step: local query rows ``q`` and rows ``kv`` of the
    key/value block held (half-open ``(start, stop)``), with or without the
    top-left causal mask."""

    q: tuple[int, int]
    kv: tuple[int, int]
    causal: bool

    @property
    def work(self) -> int:
        """Query-key pairs the kernel visits (about half of them when causal)."""
        return (self.q[1] - self.q[0]) * (self.kv[1] - self.kv[0])


HELD = ("own", "earlier", "later")


def step_blocks(layout: str, is_causal: bool, seqlen_q: int, seqlen_kv: int,
                held: str) -> tuple[Block, ...]:
    """The kernel calls of a ring step on local lengths `seqlen_q`/`seqlen_kv`.

    `held`: which key/value block the device holds: its ``"own"`` (step 0),
    or another that precedes (``"earlier"``) or follows (``"later"``) its own
    in the sequence. The own block always covers all rows. Causal calls need
    ``seqlen_q == seqlen_kv`` and, with ``"zigzag"``, an even length.
    """
    if held not in HELD:
        raise ValueError(f"held must be one of {HELD}, got {held!r}")
    everything = Block((0, seqlen_q), (0, seqlen_kv), False)
    if held == "own":
        # With either layout the causal kernel on the whole local block is
        # exact (zigzag: chunk 2P-1-d sees all of chunk d, chunk d sees none of
        # chunk 2P-1-d, the diagonals are causal).
        return (dataclasses.replace(everything, causal=is_causal),)
    if not is_causal:
        return (everything,)
    if layout == "contiguous":
        return (everything,) if held == "earlier" else ()
    c = seqlen_q // 2
    if held == "earlier":
        # Its first chunk precedes both of ours; its second follows both.
        return (Block((0, seqlen_q), (0, c), False),)
    # Its chunks lie between our two: our second chunk sees both of them.
    return (Block((c, seqlen_q), (0, seqlen_kv), False),)


def global_positions(layout: str, num_devices: int, device: int, local_len: int) -> np.ndarray:
    """Positions in the natural sequence order of device `device`'s `local_len` tokens."""
    if layout == "contiguous":
        return device * local_len + np.arange(local_len)
    c = local_len // 2
    chunks = (device, 2 * num_devices - 1 - device)
    return np.concatenate([k * c + np.arange(c) for k in chunks])


def _check(seq_len: int, num_devices: int) -> None:
    if not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    if seq_len % (2 * num_devices):
        raise ValueError(
            f"the zigzag layout cuts the sequence into 2 * num_devices = {2 * num_devices} "
            f"equal chunks, but its length {seq_len} is not divisible by {2 * num_devices}"
        )


def zigzag_permute(x, num_devices: int, axis: int = 1):
    """`x` in natural token order along `axis` -> zigzag order for `num_devices`.

    Chunk order ``0, 2P-1, 1, 2P-2, ..., P-1, P``: shard the result
    contiguously along `axis` (e.g. ``PartitionSpec(None, "seq")``) and device
    ``d`` holds chunks ``d`` and ``2P-1-d``. Apply it to everything indexed by
    token (inputs, targets, position ids) once at the model input.
    """
    x = jnp.asarray(x)
    axis = axis % x.ndim
    T, P = x.shape[axis], num_devices
    _check(T, P)
    c = T // (2 * P)
    y = x.reshape(x.shape[:axis] + (2, P, c) + x.shape[axis + 1:])
    first = jnp.take(y, 0, axis=axis)
    second = jnp.flip(jnp.take(y, 1, axis=axis), axis=axis)  # chunks 2P-1, ..., P
    y = jnp.stack([first, second], axis=axis + 1)  # [.., P, 2, c, ..]
    return y.reshape(x.shape)


def zigzag_unpermute(x, num_devices: int, axis: int = 1):
    """Inverse of `zigzag_permute`: zigzag order along `axis` -> natural order."""
    x = jnp.asarray(x)
    axis = axis % x.ndim
    T, P = x.shape[axis], num_devices
    _check(T, P)
    c = T // (2 * P)
    y = x.reshape(x.shape[:axis] + (P, 2, c) + x.shape[axis + 1:])
    first = jnp.take(y, 0, axis=axis + 1)
    second = jnp.flip(jnp.take(y, 1, axis=axis + 1), axis=axis)
    return jnp.stack([first, second], axis=axis).reshape(x.shape)


def zigzag_indices(seq_len: int, num_devices: int) -> np.ndarray:
    """The natural positions of the tokens in zigzag order (int array [seq_len]):
    ``zigzag_permute(x)[:, i] == x[:, zigzag_indices(T, P)[i]]``. Use them as
    position ids (e.g. for rotary embeddings) of the permuted sequence."""
    _check(seq_len, num_devices)
    c = seq_len // (2 * num_devices)
    return np.concatenate([global_positions("zigzag", num_devices, d, 2 * c) for d in range(num_devices)])
