"""jaxattn.flash_attention: the differentiable public entry point.

A jax.custom_vjp whose forward and backward are the compiled kernels'
ffi_calls. The residuals kept for the backward are (q, k, v, out, lse):
never a T x S matrix.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import _ffi_calls, dispatch, reference, sharding
from ._validation import check_inputs


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static choices of one call (a custom_vjp non-differentiable argument)."""

    scale: float
    is_causal: bool
    implementation: str | None  # None, "cpu", "cuda" or "cuda_sm80"
    cuda_ok: bool  # the CUDA kernels cover this call
    window: tuple[int, int] | None = None  # local window (left, right)
    # Per-batch lengths are extra operands (q_lengths, kv_lengths) of the
    # kernel calls; they are never None inside the kernels when this is set.
    has_lengths: bool = False
    softcap: float | None = None  # logits_soft_cap
    deterministic: bool = False  # ordered dQ accumulation in the CUDA backward


def _reference_forward(q, k, v, q_lengths=None, kv_lengths=None, *, scale, is_causal, window=None,
                       softcap=None):
    return reference.attention(q, k, v, scale=scale, is_causal=is_causal, window=window,
                               q_lengths=q_lengths, kv_lengths=kv_lengths, softcap=softcap)


def _reference_backward(q, k, v, out, lse, dout, dlse, q_lengths=None, kv_lengths=None, *, scale,
                        is_causal, window=None, softcap=None):
    del out, lse  # the reference recomputes what it needs
    fn = functools.partial(reference.attention, scale=scale, is_causal=is_causal, window=window,
                           q_lengths=q_lengths, kv_lengths=kv_lengths, softcap=softcap)
    _, vjp = jax.vjp(fn, q, k, v)
    return vjp((dout, dlse))


@functools.lru_cache(maxsize=256)
def _local(plan: _Plan, cpu, cuda, ref, cuda_options=()):
    """The kernel of `plan` on one device's arrays, per platform when none is forced.

    `cuda_options`: extra (name, value) keyword pairs of the CUDA function.
    Cached: one function per plan, so its sharded (jitted) wrapper is reused.
    """
    kw = dict(scale=plan.scale, is_causal=plan.is_causal)
    # Only the CPU kernel and the reference take the mask options (the CUDA
    # kernels are never picked for masked calls: plan.cuda_ok is False).
    mkw = dict(kw, window=plan.window, softcap=plan.softcap)
    # The FFI calls' results typed like their inputs inside shard_map.
    cpu = sharding.typed_per_device(functools.partial(cpu, **mkw))
    cuda = sharding.typed_per_device(functools.partial(cuda, **kw, **dict(cuda_options)))
    ref = functools.partial(ref, **mkw)
    if plan.implementation == "reference":  # reached from ring attention's blocks
        return ref
    if plan.implementation == "cpu":
        return cpu
    if plan.implementation in ("cuda", "cuda_sm80"):
        return cuda
    return lambda *args: jax.lax.platform_dependent(
        *args, cpu=cpu, cuda=cuda if plan.cuda_ok else ref, default=ref
    )


def forward_kernel(plan: _Plan):
    """The per-device forward ``(q, k, v[, q_lengths, kv_lengths]) -> (out, lse)`` of `plan`."""
    cuda = _ffi_calls.cuda_sm80_forward if plan.implementation == "cuda_sm80" else _ffi_calls.cuda_forward
    return _local(plan, _ffi_calls.cpu_forward, cuda, _reference_forward)


def backward_kernel(plan: _Plan, reference_backward=_reference_backward):
    """The per-device backward ``(q, k, v, out, lse, dout, dlse[, lengths]) -> (dq, dk, dv)``.

    The compiled kernels take the softmax statistics from the given ``out``
    and ``lse``; `reference_backward` is the pure-JAX one used where they do
    not run (by default it recomputes them from q, k, v).
    """
    cuda = _ffi_calls.cuda_sm80_backward if plan.implementation == "cuda_sm80" else _ffi_calls.cuda_backward
    return _local(plan, _ffi_calls.cpu_backward, cuda, reference_backward,
                  (("deterministic", plan.deterministic),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_lengths, kv_lengths, plan: _Plan):
    # q_lengths / kv_lengths: int32 [B] when plan.has_lengths, else None.
    local = forward_kernel(plan)
    lengths = (q_lengths, kv_lengths) if plan.has_lengths else ()
    return sharding.partitioned_forward(local, q, k, v, *lengths)


def _flash_fwd(q, k, v, q_lengths, kv_lengths, plan: _Plan):
    out, lse = _flash(q, k, v, q_lengths, kv_lengths, plan)
    return (out, lse), (q, k, v, out, lse, q_lengths, kv_lengths)


def _flash_bwd(plan: _Plan, residuals, cotangents):
    q, k, v, out, lse, q_lengths, kv_lengths = residuals
    dout, dlse = cotangents
    local = backward_kernel(plan)
    lengths = (q_lengths, kv_lengths) if plan.has_lengths else ()
    dq, dk, dv = sharding.partitioned_backward(
        local, q, k, v, out, lse, dout.astype(q.dtype), dlse.astype(jnp.float32), *lengths
    )
    # Integer lengths have no cotangent.
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    query,
    key,
    value,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    return_residual: bool = False,
    implementation: str | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    logits_soft_cap: float | None = None,
    deterministic: bool = False,
):
    """Scaled dot-product attention, memory-efficient, with hand-written kernels.

    Mirrors ``jax.nn.dot_product_attention``:

    Args:
      query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``), bfloat16, float16
        or float32.
      key, value: ``[B, S, K, H]`` with ``N % K == 0`` (GQA/MQA), same dtype.
      scale: static Python float multiplying ``q.k``; default ``1/sqrt(H)``.
      is_causal: top-left aligned causal mask (query ``i`` sees keys
        ``j <= i``), exactly as in ``jax.nn.dot_product_attention``.
      return_residual: also return the logsumexp of the scaled logits,
        natural log, float32 ``[B, T, N]``.
      implementation: ``None`` picks the best kernel for the platform (see
        ``jaxattn.kernel_for``); ``"cuda"``, ``"cpu"`` or ``"reference"``
        (pure JAX) force one; ``"cuda_sm80"`` forces the portable CUDA
        kernels even where a Hopper kernel exists. A forced kernel that
        cannot run the call raises ``NotImplementedError``.
      local_window_size: ``None``, an int ``w`` or a ``(left, right)`` tuple
        of static non-negative ints: query ``i`` sees keys
        ``i - left <= j <= i + right`` (``w`` means ``(w, w)``); combined
        with ``is_causal`` (both must hold), as in
        ``jax.nn.dot_product_attention``.
      query_seq_lengths, key_value_seq_lengths: int32 ``[B]`` arrays (traced
        values allowed; shape ``()`` or ``(1,)`` for an unbatched query):
        query rows ``i >= query_seq_lengths[b]`` get output 0, keys
        ``j >= key_value_seq_lengths[b]`` are invisible.
      logits_soft_cap: static positive float ``c`` (not in jax.nn): the
        scaled logits become ``c * tanh(logits / c)`` before masking and
        softmax (the lse residual is of the capped logits).

      deterministic: static bool (not in jax.nn). ``True`` makes the CUDA
        backward add the query gradient of each key block in a fixed order,
        so gradients are identical bit for bit from run to run (a little
        slower); by default the blocks add in whatever order they finish.
        The CPU kernel and the reference are always deterministic.

    A query row that sees no key (a padded row, or a mask that excludes all
    its keys) gets output 0, lse ``-inf`` and zero gradients. (Unlike
    ``jax.nn.dot_product_attention``, whose masked logits are a large
    finite negative number, so a fully masked but unpadded row gets the mean
    of the values there.) The CUDA kernels do not take these options yet:
    with them, ``implementation=None`` runs the reference on GPUs and
    ``"cuda"`` raises ``NotImplementedError``.

    Returns:
      ``out`` with the query's shape and dtype, or ``(out, lse)``.
    """
    spec = check_inputs(
        query, key, value, scale=scale, is_causal=is_causal, implementation=implementation,
        local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
    )
    dispatch.check_forced(spec, implementation)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    has_lengths = spec.has_q_lengths or spec.has_kv_lengths
    q_lengths = kv_lengths = None
    if has_lengths:
        # Both or neither reach the kernels; a missing one is the full length.
        q_lengths = (jnp.full((B,), T, jnp.int32) if query_seq_lengths is None
                     else jnp.asarray(query_seq_lengths).reshape(B))
        kv_lengths = (jnp.full((B,), S, jnp.int32) if key_value_seq_lengths is None
                      else jnp.asarray(key_value_seq_lengths).reshape(B))

    if spec.batch == 0 or spec.seqlen_q == 0:
        # Nothing to attend from: no kernel call; gradients are zeros.
        out = jnp.zeros(query.shape, query.dtype)
        lse = jnp.zeros(query.shape[:-1], jnp.float32)
    elif implementation == "reference":
        out, lse = reference.attention(query, key, value, scale=spec.scale, is_causal=spec.is_causal,
                                       window=spec.window, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                       softcap=spec.softcap)
    else:
        plan = _Plan(
            scale=spec.scale,
            is_causal=spec.is_causal,
            implementation=implementation,
            cuda_ok=dispatch.cuda_unsupported_reason(spec) is None,
            window=spec.window,
            has_lengths=has_lengths,
            softcap=spec.softcap,
            deterministic=bool(deterministic),
        )
        out, lse = _flash(query, key, value, q_lengths, kv_lengths, plan)

    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out
