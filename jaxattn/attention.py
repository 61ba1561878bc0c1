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
from jax.custom_derivatives import SymbolicZero

from . import _ffi_calls, dispatch, reference, remat, sharding
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
    has_segments: bool = False  # q_segment_ids, kv_segment_ids operands
    # Dense operands: their sharding kinds (sharding.dense_kind), None when absent.
    bias_kind: str | None = None
    mask_kind: str | None = None
    # Backward only: whether the bias is differentiated (else no dbias is computed).
    bias_grad: bool = True

    def extra_names(self) -> tuple[str, ...]:
        """The mask operands after q, k, v (the kernels' keyword names), in order."""
        names = ()
        if self.has_lengths:
            names += ("q_lengths", "kv_lengths")
        if self.has_segments:
            names += ("q_segment_ids", "kv_segment_ids")
        if self.bias_kind is not None:
            names += ("bias",)
        if self.mask_kind is not None:
            names += ("mask",)
        return names

    def extra_kinds(self) -> tuple[str, ...]:
        kinds = {"q_lengths": "len", "kv_lengths": "len", "q_segment_ids": "segq", "kv_segment_ids": "segk",
                 "bias": self.bias_kind, "mask": self.mask_kind}
        return tuple(kinds[n] for n in self.extra_names())


def _reference_forward(q, k, v, *, scale, is_causal, window=None, softcap=None, **masks):
    return reference.attention(q, k, v, scale=scale, is_causal=is_causal, window=window, softcap=softcap,
                               **masks)


def _reference_backward(q, k, v, out, lse, dout, dlse, *, scale, is_causal, window=None, softcap=None,
                        bias=None, bias_grad=True, **masks):
    del out, lse  # the reference recomputes what it needs
    fn = functools.partial(reference.attention, scale=scale, is_causal=is_causal, window=window,
                           softcap=softcap, **masks)
    if bias is None or not bias_grad:
        _, vjp = jax.vjp(functools.partial(fn, bias=bias), q, k, v)
        return vjp((dout, dlse))
    _, vjp = jax.vjp(lambda q, k, v, b: fn(q, k, v, bias=b), q, k, v, bias.astype(jnp.float32))
    return vjp((dout, dlse))


def _named(fn, fixed: int, names: tuple[str, ...]):
    """`fn` taking its first `fixed` operands positionally and the rest as keywords `names`."""
    return lambda *args: fn(*args[:fixed], **dict(zip(names, args[fixed:])))


@functools.lru_cache(maxsize=256)
def _local(plan: _Plan, cpu, cuda, ref, fixed: int, cuda_options=()):
    """The kernel of `plan` on one device's arrays (`fixed` operands, then the
    plan's mask operands), per platform when none is forced.

    `cuda_options`: extra (name, value) keyword pairs of the CUDA function.
    Cached: one function per plan, so its sharded (jitted) wrapper is reused.
    """
    # Every kernel takes the mask operands and options (the CUDA kernels are
    # picked only for what they cover: plan.cuda_ok).
    mkw = dict(scale=plan.scale, is_causal=plan.is_causal, window=plan.window, softcap=plan.softcap)
    names = plan.extra_names()
    # The bias gradient (backward) corresponds to the bias operand.
    grad_args = (fixed + names.index("bias"),) if "bias" in names and plan.bias_grad else ()
    if fixed == 7 and "bias" in names:  # the backward takes whether dbias is wanted
        mkw["bias_grad"] = plan.bias_grad
    # The FFI calls' results typed like their inputs inside shard_map.
    cpu = sharding.typed_per_device(_named(functools.partial(cpu, **mkw), fixed, names), grad_args)
    cuda = sharding.typed_per_device(_named(functools.partial(cuda, **mkw, **dict(cuda_options)), fixed, names),
                                     grad_args)
    ref = _named(functools.partial(ref, **mkw), fixed, names)
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
    """The per-device forward ``(q, k, v, *mask operands) -> (out, lse)`` of `plan`."""
    cuda = _ffi_calls.cuda_sm80_forward if plan.implementation == "cuda_sm80" else _ffi_calls.cuda_forward
    return _local(plan, _ffi_calls.cpu_forward, cuda, _reference_forward, 3)


def backward_kernel(plan: _Plan, reference_backward=_reference_backward):
    """The per-device backward ``(q, k, v, out, lse, dout, dlse, *mask operands) -> (dq, dk, dv[, dbias])``.

    The compiled kernels take the softmax statistics from the given ``out``
    and ``lse``; `reference_backward` is the pure-JAX one used where they do
    not run (by default it recomputes them from q, k, v).
    """
    cuda = _ffi_calls.cuda_sm80_backward if plan.implementation == "cuda_sm80" else _ffi_calls.cuda_backward
    return _local(plan, _ffi_calls.cpu_backward, cuda, reference_backward, 7,
                  (("deterministic", plan.deterministic),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, extras, plan: _Plan):
    # extras: the plan's mask operands (plan.extra_names()), a tuple of arrays.
    from .ring import auto  # noqa: PLC0415 - jaxattn.ring imports this module
    return sharding.partitioned_forward(forward_kernel(plan), q, k, v, extras, plan.extra_kinds(),
                                        auto.forward_rule(plan))


def _flash_fwd(q, k, v, extras, plan: _Plan):
    # symbolic_zeros: the primals say whether they are differentiated; the
    # bias gradient is computed only when the bias is (an empty residual,
    # () or None, carries that to the backward).
    bias_grad = any(x.perturbed for name, x in zip(plan.extra_names(), extras) if name == "bias")
    q, k, v = q.value, k.value, v.value
    extras = tuple(x.value for x in extras)
    # Named (remat.py) so that a jax.checkpoint policy can keep them rather
    # than run the forward kernel again in the backward pass.
    out, lse = remat.name_residuals(*_flash(q, k, v, extras, plan))
    return (out, lse), (q, k, v, out, lse, extras, () if bias_grad else None)


def _flash_bwd(plan: _Plan, residuals, cotangents):
    q, k, v, out, lse, extras, bias_grad = residuals
    plan = dataclasses.replace(plan, bias_grad=plan.bias_kind is not None and bias_grad is not None)
    dout, dlse = cotangents
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    if isinstance(dlse, SymbolicZero):
        dlse = jnp.zeros(lse.shape, jnp.float32)
    local = backward_kernel(plan)
    extra_out = (plan.bias_kind,) if plan.bias_grad else ()
    from .ring import auto  # noqa: PLC0415 - jaxattn.ring imports this module
    grads = sharding.partitioned_backward(
        local, q, k, v, out, lse, dout.astype(q.dtype), dlse.astype(jnp.float32), extras, plan.extra_kinds(),
        extra_out, auto.backward_rule(plan),
    )
    dq, dk, dv = grads[:3]
    # Integer and boolean operands have no cotangent; the bias has dbias.
    d_extras = tuple(
        grads[3].astype(x.dtype) if name == "bias" and plan.bias_grad else None
        for name, x in zip(plan.extra_names(), extras)
    )
    return dq, dk, dv, d_extras


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


def flash_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    return_residual: bool = False,
    implementation: str | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    logits_soft_cap: float | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
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
        scaled logits ``scale * q.k`` become ``c * tanh(scale * q.k / c)``
        before the bias is added and before masking and softmax (the lse
        residual is of the final logits).
      bias: additive bias of the logits, any float dtype, broadcastable to
        ``[B, N, T, S]`` (``[N, T, S]`` unbatched); read in place with
        broadcast strides (never expanded), differentiable.
      mask: bool, True = attend, broadcastable likewise.
      q_segment_ids, kv_segment_ids: int32 ``[B, T]`` / ``[B, S]``, both or
        neither (not in jax.nn): a query attends only keys with its own
        segment id (packed documents); with ``is_causal`` that is causal
        attention within each document. The CPU kernel skips key blocks
        whose ids cannot match, so packed documents cost about what the
        documents cost separately.

      deterministic: static bool (not in jax.nn). ``True`` makes the CUDA
        backward add the query gradient of each key block in a fixed order,
        so gradients are identical bit for bit from run to run (slower: on an
        H200 at 16K tokens, 1.2-1.3x the default's fwd+bwd time, with or
        without a window or lengths); by default the blocks add in
        whatever order they finish.
        The CPU kernel and the reference are always deterministic.

    A query row that sees no key (a padded row, or a mask that excludes all
    its keys) gets output 0, lse ``-inf`` and zero gradients. (Unlike
    ``jax.nn.dot_product_attention``, whose masked logits are a large
    finite negative number, so a fully masked but unpadded row gets the mean
    of the values there.) On Hopper GPUs, windows, lengths, segment ids and
    the soft cap run on the Hopper kernels (deterministic mode too); the
    dense bias / mask on the portable CUDA kernels.

    Returns:
      ``out`` with the query's shape and dtype, or ``(out, lse)``.
    """
    spec = check_inputs(
        query, key, value, scale=scale, is_causal=is_causal, implementation=implementation,
        local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, bias=bias, mask=mask,
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

    masks = {}
    if has_lengths:
        masks.update(q_lengths=q_lengths, kv_lengths=kv_lengths)
    if spec.has_segments:
        masks.update(q_segment_ids=jnp.asarray(q_segment_ids).reshape(B, T),
                     kv_segment_ids=jnp.asarray(kv_segment_ids).reshape(B, S))
    # Dense operands as rank 4 (a reshape that adds size-1 dims: no copy).
    if spec.bias_shape is not None:
        masks["bias"] = jnp.asarray(bias).reshape(spec.bias_shape)
    if spec.mask_shape is not None:
        masks["mask"] = jnp.asarray(mask).reshape(spec.mask_shape)

    if spec.batch == 0 or spec.seqlen_q == 0:
        # Nothing to attend from: no kernel call; gradients are zeros.
        out = jnp.zeros(query.shape, query.dtype)
        lse = jnp.zeros(query.shape[:-1], jnp.float32)
    elif implementation == "reference":
        out, lse = reference.attention(query, key, value, scale=spec.scale, is_causal=spec.is_causal,
                                       window=spec.window, softcap=spec.softcap, **masks)
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
            has_segments=spec.has_segments,
            bias_kind=None if spec.bias_shape is None else sharding.dense_kind(spec.bias_shape, B, spec.num_heads),
            mask_kind=None if spec.mask_shape is None else sharding.dense_kind(spec.mask_shape, B, spec.num_heads),
        )
        plan_names = plan.extra_names()
        out, lse = _flash(query, key, value, tuple(masks[n] for n in plan_names), plan)

    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out
