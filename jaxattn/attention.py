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


def _reference_forward(q, k, v, *, scale, is_causal):
    return reference.attention(q, k, v, scale=scale, is_causal=is_causal)


def _reference_backward(q, k, v, out, lse, dout, dlse, *, scale, is_causal):
    del out, lse  # the reference recomputes what it needs
    fn = functools.partial(reference.attention, scale=scale, is_causal=is_causal)
    _, vjp = jax.vjp(fn, q, k, v)
    return vjp((dout, dlse))


@functools.lru_cache(maxsize=256)
def _local(plan: _Plan, cpu, cuda, ref):
    """The kernel of `plan` on one device's arrays, per platform when none is forced.

    Cached: one function per plan, so its sharded (jitted) wrapper is reused.
    """
    kw = dict(scale=plan.scale, is_causal=plan.is_causal)
    # The FFI calls' results typed like their inputs inside shard_map.
    cpu = sharding.typed_per_device(functools.partial(cpu, **kw))
    cuda = sharding.typed_per_device(functools.partial(cuda, **kw))
    ref = functools.partial(ref, **kw)
    if plan.implementation == "cpu":
        return cpu
    if plan.implementation in ("cuda", "cuda_sm80"):
        return cuda
    return lambda *args: jax.lax.platform_dependent(
        *args, cpu=cpu, cuda=cuda if plan.cuda_ok else ref, default=ref
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, plan: _Plan):
    cuda = _ffi_calls.cuda_sm80_forward if plan.implementation == "cuda_sm80" else _ffi_calls.cuda_forward
    local = _local(plan, _ffi_calls.cpu_forward, cuda, _reference_forward)
    return sharding.partitioned_forward(local, q, k, v)


def _flash_fwd(q, k, v, plan: _Plan):
    out, lse = _flash(q, k, v, plan)
    return (out, lse), (q, k, v, out, lse)


def _flash_bwd(plan: _Plan, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    local = _local(plan, _ffi_calls.cpu_backward, _ffi_calls.cuda_backward, _reference_backward)
    dq, dk, dv = sharding.partitioned_backward(
        local, q, k, v, out, lse, dout.astype(q.dtype), dlse.astype(jnp.float32)
    )
    return dq, dk, dv


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

    Returns:
      ``out`` with the query's shape and dtype, or ``(out, lse)``.
    """
    spec = check_inputs(
        query, key, value, scale=scale, is_causal=is_causal, implementation=implementation
    )
    dispatch.check_forced(spec, implementation)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]

    if spec.batch == 0 or spec.seqlen_q == 0:
        # Nothing to attend from: no kernel call; gradients are zeros.
        out = jnp.zeros(query.shape, query.dtype)
        lse = jnp.zeros(query.shape[:-1], jnp.float32)
    elif implementation == "reference":
        out, lse = reference.attention(query, key, value, scale=spec.scale, is_causal=spec.is_causal)
    else:
        plan = _Plan(
            scale=spec.scale,
            is_causal=spec.is_causal,
            implementation=implementation,
            cuda_ok=dispatch.cuda_unsupported_reason(spec) is None,
        )
        out, lse = _flash(query, key, value, plan)

    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out
