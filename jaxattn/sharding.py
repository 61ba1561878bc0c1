"""Sharding rules of the attention kernels: batch and heads shard locally, the sequence runs a ring.

Without a rule, XLA's SPMD partitioner treats a custom call as opaque and
all-gathers its operands. Here each kernel call (forward and backward) is
wrapped in ``jax.experimental.custom_partitioning`` so that, under ``jax.jit``
with sharded inputs, every device runs the kernel on its own shard:

* the batch dimension ``B`` of all operands and results shards freely;
* the head dimensions shard too, query heads ``N`` and key/value heads ``K``
  together: with GQA (``N = K * G``) the query heads of one shard must be
  exactly the groups of that shard's key/value heads, so heads sharded over
  mesh axes of total size ``d`` need ``K % d == 0`` and the key/value heads
  sharded over the same axes;
* the sequence dimensions ``T``/``S`` shard together over the same mesh axes:
  each device then runs the caller's ``SequenceRule`` function (ring attention,
  jaxattn/ring/auto.py) with those axes bound, so it may use collectives
  (``ppermute``) over them; calls the ring cannot take (masks) raise;
* the head dimension ``H`` never shards: an operand sharded there raises
  instead of being gathered silently.

Both partitioners are covered: Shardy uses the einsum-like ``sharding_rule``
(with ``N`` the compound factor ``(k g)``), GSPMD the
``infer_sharding_from_operands`` callback; both end in the same ``partition``
callback, which validates the shardings and runs the per-device function.
Residuals (``lse``) shard like the query, and the CUDA backward's workspace
outputs are created inside the per-device function, so they are local too.

``custom_partitioning`` has no batching rule, so the wrapped call is also a
``custom_vmap`` whose rule adds the vmapped dimension as one more leading,
batch-like dimension (shardable like ``B``); the per-device function folds the
leading dimensions into the batch, as the kernels' ``broadcast_all`` FFI
handlers do.

The wrapped call is a ``jax.jit(..., inline=True)``, cached per kernel
function: inside a user's jit it is inlined, and an eager call on sharded
arrays is partitioned too. Mesh axes of size 1 are ignored.

Inside ``shard_map`` the arrays are already per-device and the kernel is called
directly (no custom_partitioning); ``typed_per_device`` gives the FFI calls'
results the varying-manual-axes types shard_map checks. On a mesh with
Explicit axes the shardings are part of the types, so the same decision is
made at trace time (raising the real exception) and the kernel runs under a
``shard_map`` over the Explicit axes.

The partitioner calls ``partition`` while compiling, and wraps what it raises:
under ``jax.jit`` (Auto axes) an unsupported sharding surfaces as a
``jax.errors.JaxRuntimeError`` whose message holds our exception's type and
text.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["partitioned_forward", "partitioned_backward", "typed_per_device"]

# Operand layouts, after E >= 0 leading vmapped dimensions (which shard like B):
# q-like [..., B, T, N, H], kv-like [..., B, S, K, H], lse-like [..., B, T, N].
# Optional trailing operands (masks): per-batch lengths [..., B] (int32) and
# segment ids [..., B, T] / [..., B, S], sharded like the batch; dense bias
# and mask [..., Bb, Nb, Tb, Sb] (kind "dense" + one 0/1 flag per dim: 1 when
# that dimension is full, 0 when broadcast), sharded like the batch and heads
# on their full dimensions. A dense result (the bias gradient) is summed over
# the mesh axes its broadcast batch / head dimensions would have split.
_Q, _KV, _LSE, _LEN, _SEGQ, _SEGK = "q", "kv", "lse", "len", "segq", "segk"
_FWD_IN = (_Q, _KV, _KV)
_FWD_OUT = (_Q, _LSE)
_BWD_IN = (_Q, _KV, _KV, _Q, _LSE, _Q, _LSE)
_BWD_OUT = (_Q, _KV, _KV)
_FWD_NAMES = ("query", "key", "value")
_BWD_NAMES = ("query", "key", "value", "out", "lse", "dout", "dlse")
_CHECKED = 3  # q, k, v are validated; the other operands are resharded to match


def _seq_name(kind: str, e: int) -> str:
    return f"sequence dimension {'T' if kind == _Q else 'S'} (dim {e + 1})"


def _forbidden(kind: str, e: int, seq_ok: bool):
    """The dimensions of a `kind` operand that may not shard: (index, description)."""
    dims = [] if seq_ok else [(e + 1, _seq_name(kind, e))]
    if kind != _LSE:
        dims.append((e + 3, f"head dimension H (dim {e + 3})"))
    return dims


class SequenceRule(NamedTuple):
    """What runs when the sequence dimensions (T and S) are sharded over mesh axes.

    ``make(axes)`` returns the per-device function (same operands and results
    as the kernel's, on the local shards) that runs with the sequence sharded
    over the mesh axes ``axes`` (ring attention: jaxattn/ring/auto.py); it may
    use collectives over those axes. ``None`` with ``why_not`` saying why a
    sequence-sharded call cannot run (e.g. masks the ring does not take).
    """

    make: Callable[[tuple[str, ...]], Callable] | None
    why_not: str = ""


NO_SEQUENCE = SequenceRule(None, "")


# ---------------------------------------------------------------------------
# Shardy: the einsum-like rule. N is the compound factor (k g) under GQA, so
# Shardy shards query and key/value heads together.

def _rule_string(kinds_in, kinds_out, e: int, N: int, K: int) -> tuple[str, dict]:
    lead = " ".join(f"b{i}" for i in range(e + 1))
    if N == K:
        n, sizes = "k", {}
    elif K == 1:  # MQA: Shardy rejects a size-1 factor in a larger dim
        n, sizes = "g", {}
    else:
        n, sizes = "(k g)", {"g": int(N // K)}
    dims = {_Q: f"{lead} t {n} h", _KV: f"{lead} s k h", _LSE: f"{lead} t {n}", _LEN: lead,
            _SEGQ: f"{lead} t", _SEGK: f"{lead} s"}
    outer = " ".join(f"b{i}" for i in range(e))

    def spell(kind, i):
        if not _is_dense(kind):
            return dims[kind]
        full = _dense_flags(kind)
        names = (f"b{e}", n, "t", "s")
        # A broadcast (size-1) dimension gets a factor of its own.
        parts = [names[d] if full[d] else f"u{i}x{d}" for d in range(4)]
        return " ".join(([outer] if outer else []) + parts)

    ins = ", ".join(spell(x, i) for i, x in enumerate(kinds_in))
    outs = ", ".join(spell(x, len(kinds_in) + i) for i, x in enumerate(kinds_out))
    return f"{ins} -> {outs}", sizes


def dense_kind(shape, batch: int, heads: int) -> str:
    """The kind of a dense [..., Bb, Nb, Tb, Sb] operand against [batch, heads, T, S]."""
    b, n, t, s = shape[-4:]
    return "dense" + "".join("1" if x > 1 or full == 1 else "0"
                             for x, full in ((b, batch), (n, heads), (t, 2), (s, 2)))


def _is_dense(kind: str) -> bool:
    return kind.startswith("dense")


def _dense_flags(kind: str) -> tuple[bool, ...]:
    return tuple(c == "1" for c in kind[5:])


def _shape(ir_type) -> tuple[int, ...]:
    """Shape of an MLIR tensor type (what a callable sharding_rule receives)."""
    shape = getattr(ir_type, "shape", None)
    if shape is None:  # not downcast to RankedTensorType
        from jax._src.lib.mlir import ir

        shape = ir.RankedTensorType(ir_type).shape
    return tuple(shape)


def _sharding_rule(kinds_in, kinds_out):
    def rule(mesh, operand_types, result_types):
        del mesh, result_types
        q, k = _shape(operand_types[0]), _shape(operand_types[1])
        return _rule_string(kinds_in, kinds_out, len(q) - 4, q[-2], k[-2])

    return rule


# ---------------------------------------------------------------------------
# The decision shared by both partitioners.

def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def _spec_dims(sharding, ndim: int) -> list[tuple[str, ...]] | None:
    """Per-dimension mesh axes of a sharding; None when it has no named axes."""
    if sharding is None:
        return [()] * ndim
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return [_axes(x) for x in spec[:ndim]]
    if sharding.is_fully_replicated:
        return [()] * ndim
    return None


def _axis_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _fmt(axes) -> str:
    return ", ".join(repr(a) for a in axes)


def _forbidden_message(name: str, what: str, axes, seq_rule: SequenceRule) -> str:
    if "sequence" in what and seq_rule.why_not:
        return (f"jaxattn.flash_attention: the {name}'s {what} is sharded over mesh axis {_fmt(axes)}, "
                f"which would run ring attention, but {seq_rule.why_not}. Replicate the sequence "
                "dimension, or shard the batch or heads instead.")
    dims = ("batch (B), head (N, K) and sequence (T, S: ring attention)" if seq_rule.make
            else "batch (B) and head (N, K)")
    hint = "" if seq_rule.make else " (for a sharded sequence call jaxattn.ring_attention inside jax.shard_map)"
    return (f"jaxattn.flash_attention: the {name}'s {what} is sharded over mesh axis {_fmt(axes)}; only the "
            f"{dims} dimensions can be sharded{hint}. Replicate that dimension, e.g. "
            "PartitionSpec('batch', None, 'heads', None).")


def _choose(mesh, arg_shapes, names, *, strict: bool, seq_rule: SequenceRule = NO_SEQUENCE):
    """(per-batch-dim axes, head axes, sequence axes) to run with, from the operands' shardings.

    The query decides; the key/value follow (or decide where the query is not
    sharded on that dimension). With ``strict``, shardings that cannot run
    locally raise: head-dim sharding, or sequence sharding without a usable
    `seq_rule` (NotImplementedError); heads that do not split into whole GQA
    groups, or query and key/value sequences sharded over different mesh axes
    (ValueError).
    """
    q, k = arg_shapes[0], arg_shapes[1]
    e = len(q.shape) - 4
    N, K = q.shape[-2], k.shape[-2]
    seq_ok = seq_rule.make is not None
    specs = []
    for i, (x, kind) in enumerate(zip(arg_shapes[:_CHECKED], (_Q, _KV, _KV))):
        dims = _spec_dims(x.sharding, len(x.shape))
        if dims is None:
            if strict:
                raise NotImplementedError(
                    f"jaxattn.flash_attention: the {names[i]} has a sharding without "
                    f"named mesh axes ({x.sharding}); shard it with a NamedSharding on a "
                    "Mesh (jax.jit in_shardings, jax.device_put or jax.sharding.set_mesh)."
                )
            dims = [()] * len(x.shape)
        # Axes of size 1 split nothing.
        dims = [tuple(a for a in axes if mesh.shape[a] > 1) for axes in dims]
        specs.append(dims)
        if strict:
            for d, what in _forbidden(kind, e, seq_ok):
                if dims[d]:
                    raise NotImplementedError(_forbidden_message(names[i], what, dims[d], seq_rule))
    # The sequence (ring attention): T and S over the same axes, the query decides.
    seq = ()
    if seq_ok:
        seq = next((dims[e + 1] for dims in specs if dims[e + 1]), ())
        if strict:
            for name, dims, kind in zip(names, specs, (_Q, _KV, _KV)):
                if dims[e + 1] and dims[e + 1] != seq:
                    raise ValueError(
                        f"jaxattn.flash_attention: the {name}'s {_seq_name(kind, e)} is sharded over "
                        f"mesh axis {_fmt(dims[e + 1])} but the {names[0]}'s over {_fmt(seq)}; ring "
                        "attention needs the query's and the key/value's sequence sharded over the "
                        "same mesh axes (in the same order)."
                    )
    if strict and seq:
        d = _axis_size(mesh, seq)
        T, S = q.shape[e + 1], k.shape[e + 1]
        if T % d or S % d:
            raise ValueError(
                f"jaxattn.flash_attention: the sequence is sharded over mesh axis {_fmt(seq)} of size "
                f"{d}, but the query's T={T} or the key/value's S={S} is not divisible by {d} (XLA "
                "would pad the shards, and ring attention would attend the padding). Use lengths "
                f"divisible by {d}."
            )
    used: set = set(seq)
    batch = []
    for i in range(e + 1):
        axes = ()
        for dims in specs:  # the query first
            cand = dims[i]
            if cand and not used.intersection(cand):
                axes = cand
                break
        used.update(axes)
        batch.append(axes)
    heads = ()
    for dims in specs:
        cand = dims[e + 2]
        if cand and not used.intersection(cand):
            heads = cand
            break
    if heads:
        d = _axis_size(mesh, heads)
        if N % d or K % d:
            if strict:
                raise ValueError(
                    f"jaxattn.flash_attention: the heads are sharded over mesh axis "
                    f"{_fmt(heads)} of size {d}, but the {N} query heads and {K} key/value "
                    f"heads (GQA groups of {N // K}) cannot be split into {d} shards of "
                    f"whole groups: that needs K % {d} == 0 (here K % {d} == {K % d}). "
                    "Shard the heads over fewer devices, or replicate them."
                )
            heads = ()
    if strict:
        for name, dims in zip(names[1:3], specs[1:]):
            if dims[e + 2] and dims[e + 2] != heads:
                # e.g. Shardy split a mesh axis between the kv heads and the GQA groups.
                raise ValueError(
                    f"jaxattn.flash_attention: the {name} heads (K={K}) are sharded over "
                    f"mesh axis {_fmt(dims[e + 2])} but the query heads (N={N}) over "
                    f"{_fmt(heads) or 'no mesh axis'}; query and key/value heads must be "
                    "sharded over the same mesh axes, with K divisible by their size."
                )
    return batch, heads, seq


def _entry(axes):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def _shardings(mesh, kinds, batch, heads, seq=()):
    b = [_entry(a) for a in batch]
    n, t = _entry(heads), _entry(seq)
    specs = {_Q: P(*b, t, n, None), _KV: P(*b, t, n, None), _LSE: P(*b, t, n), _LEN: P(*b),
             _SEGQ: P(*b, t), _SEGK: P(*b, t)}

    def spec(kind):
        if not _is_dense(kind):
            return specs[kind]
        full_b, full_n, _, _ = _dense_flags(kind)
        return P(*b[:-1], b[-1] if full_b else None, n if full_n else None, None, None)

    return tuple(NamedSharding(mesh, spec(x)) for x in kinds)


def _reduced_axes(kind: str, batch, heads) -> tuple[str, ...]:
    """Mesh axes a dense result must be summed over: those of the batch / heads
    that its broadcast dimensions do not follow."""
    full_b, full_n, _, _ = _dense_flags(kind)
    return tuple(batch[-1] if not full_b else ()) + tuple(heads if not full_n else ())


def _folding(local_fn, kinds_in, kinds_out):
    """`local_fn` on rank-4 arrays, applied to arrays with extra leading dims.

    Dense operands keep their own batch dimension: their extra leading dims
    fold into one outer dimension (rank 5), which the kernels understand.
    """

    def run(*args):
        lead = args[0].shape[:-3]
        if len(lead) == 1:
            return tuple(local_fn(*args))
        flat = [a.reshape((-1,) + a.shape[-4:]) if _is_dense(k) else a.reshape((-1,) + a.shape[len(lead):])
                for a, k in zip(args, kinds_in)]
        return tuple(o.reshape(lead[:-1] + o.shape[-4:]) if _is_dense(k) else o.reshape(lead + o.shape[1:])
                     for o, k in zip(local_fn(*flat), kinds_out))

    return run


def _summing(run, kinds_out, batch, heads):
    """`run` with its dense results summed over the mesh axes they are broadcast along."""
    axes = [_reduced_axes(k, batch, heads) if _is_dense(k) else () for k in kinds_out]
    if not any(axes):
        return run

    def summed(*args):
        return tuple(jax.lax.psum(o, a) if a else o for o, a in zip(run(*args), axes))

    return summed


def _per_device(local_fn, seq_rule: SequenceRule, seq):
    """The function each device runs: the kernel, or with a sharded sequence `seq_rule`'s."""
    return seq_rule.make(seq) if seq else local_fn


def _make(local_fn, kinds_in, kinds_out, names, seq_rule):
    """custom_partitioning(local_fn) with this module's rules."""
    run = _folding(local_fn, kinds_in, kinds_out)
    cp = custom_partitioning(run)

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        batch, heads, seq = _choose(mesh, arg_shapes, names, strict=False, seq_rule=seq_rule)
        return _shardings(mesh, kinds_out, batch, heads, seq)

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        batch, heads, seq = _choose(mesh, arg_shapes, names, strict=True, seq_rule=seq_rule)
        fn = _folding(_per_device(local_fn, seq_rule, seq), kinds_in, kinds_out)
        return (
            mesh,
            _summing(fn, kinds_out, batch, heads),
            _shardings(mesh, kinds_out, batch, heads, seq),
            _shardings(mesh, kinds_in, batch, heads, seq),
        )

    cp.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_sharding_rule(kinds_in, kinds_out),
    )
    return cp


# ---------------------------------------------------------------------------
# vmap: the mapped dimension becomes one more leading batch-like dimension.

def _batchable(fn):
    f = jax.custom_batching.custom_vmap(fn)

    @f.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]
        outs = f(*args)  # itself batchable: nested vmaps add one dimension each
        return outs, (True,) * len(outs)

    return f


# ---------------------------------------------------------------------------
# shard_map: the FFI calls' results carry no varying manual axes (vma).

def _vma(x) -> frozenset:
    """The mesh axes along which `x` varies inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10: ManualAxisType
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()) or ())
    return frozenset(getattr(aval, "vma", None) or ())  # older jax


def _with_vma(x, varying: frozenset, want: frozenset):
    """`x` (computed from inputs varying over `varying`) typed as varying over `want`.

    Axes in `varying` but not in `want` are summed over (the cotangent of an
    input that is invariant along them), like JAX's own transpose of pvary.
    """
    missing = tuple(sorted(varying - _vma(x)))
    if missing:
        x = jax.lax.pcast(x, missing, to="varying")
    extra = tuple(sorted(varying - want))
    if extra:
        x = jax.lax.psum(x, extra)
    return x


def typed_per_device(ffi_fn, extra_grad_args=()):
    """`ffi_fn` (a kernel's FFI call: forward (q, k, v, ...) or backward (q, k, v,
    out, lse, dout, dlse, ...)) with results typed for shard_map.

    ``ffi_call`` results vary over no manual axis, which shard_map's type
    checks (custom_vjp, platform_dependent, out_specs) reject. Forward results
    vary like the union of the inputs; each gradient like its input (q, k, v,
    then the inputs at ``extra_grad_args``), summed over the axes that only
    the other inputs vary along. Outside shard_map this returns ``ffi_fn``'s
    results unchanged.
    """

    def fn(*args):
        outs = tuple(ffi_fn(*args))
        varying = frozenset().union(*(_vma(a) for a in args))
        if not varying:
            return outs
        if len(outs) == len(_FWD_OUT):
            return tuple(_with_vma(o, varying, varying) for o in outs)
        primals = args[:3] + tuple(args[i] for i in extra_grad_args)
        return tuple(_with_vma(g, varying, _vma(x)) for g, x in zip(outs, primals))

    return fn


def _in_shard_map() -> bool:
    """Inside a shard_map: some mesh axes are manual where this call is traced."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        return bool(mesh.manual_axes)
    except AttributeError:  # pragma: no cover - older jax
        return False


def _explicit_mesh():
    """The context mesh when it has Explicit axes (and none manual), else None."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.manual_axes or not mesh._any_axis_explicit:
            return None
        return mesh
    except AttributeError:  # pragma: no cover - older jax
        return None


class _Typed:
    """An operand's shape and sharding, as the partition callbacks see them."""

    def __init__(self, x):
        self.shape = x.shape
        self.sharding = getattr(jax.typeof(x), "sharding", None)


def _explicit(mesh, local_fn, kinds_in, kinds_out, names, seq_rule, args):
    """Explicit-sharding mode: shardings are types, so decide (and raise) now and
    run the kernel under shard_map over the mesh's Explicit axes."""
    batch, heads, seq = _choose(mesh, [_Typed(a) for a in args], names, strict=True, seq_rule=seq_rule)
    in_specs = tuple(s.spec for s in _shardings(mesh, kinds_in, batch, heads, seq))
    out_specs = tuple(s.spec for s in _shardings(mesh, kinds_out, batch, heads, seq))
    explicit = frozenset(
        n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit
    )
    args = [jax.sharding.reshard(a, sp) for a, sp in zip(args, in_specs)]
    local_fn = _summing(_per_device(local_fn, seq_rule, seq), kinds_out, batch, heads)
    fn = jax.shard_map(local_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=explicit)
    return tuple(fn(*args))


def _wrapped(local_fn, kinds_in, kinds_out, names, seq_rule):
    mesh = _explicit_mesh()
    if mesh is not None:
        return lambda *args: _explicit(mesh, local_fn, kinds_in, kinds_out, names, seq_rule, args)
    if _in_shard_map():
        # The arrays are already per-device: call the kernel directly. (With
        # every axis manual custom_partitioning would do the same; with some
        # axes left automatic its callbacks cannot name the sub-mesh, so the
        # call stays opaque and XLA replicates it along those axes.)
        return local_fn
    return _partitioned(local_fn, kinds_in, kinds_out, names, seq_rule)


@functools.lru_cache(maxsize=256)
def _partitioned(local_fn, kinds_in, kinds_out, names, seq_rule):
    # jit (inlined into an enclosing jit) so that an eager call on sharded
    # arrays is partitioned too instead of running the bare primitives; cached
    # per kernel function so eager calls reuse the executable.
    return jax.jit(_batchable(_make(local_fn, kinds_in, kinds_out, names, seq_rule)), inline=True)


def partitioned_forward(local_fn, q, k, v, extras=(), extra_kinds=(), seq_rule=NO_SEQUENCE):
    """``local_fn(q, k, v, *extras) -> (out, lse)`` run shard by shard
    (batch/heads) under jit; ``extras`` are mask operands of ``extra_kinds``
    ("len", "segq", "segk", or ``dense_kind(...)``). With the sequence sharded,
    each device runs ``seq_rule``'s function instead (ring attention)."""
    kinds = _FWD_IN + tuple(extra_kinds)
    names = _FWD_NAMES + tuple(extra_kinds)
    return tuple(_wrapped(local_fn, kinds, _FWD_OUT, names, seq_rule)(q, k, v, *extras))


def partitioned_backward(local_fn, q, k, v, out, lse, dout, dlse, extras=(), extra_kinds=(), extra_out=(),
                         seq_rule=NO_SEQUENCE):
    """``local_fn(q, k, v, out, lse, dout, dlse, *extras) -> (dq, dk, dv, *extra
    gradients)`` run shard by shard; ``extra_out`` are the kinds of the extra
    gradients (the dense bias's); ``seq_rule`` as for ``partitioned_forward``."""
    args = (q, k, v, out, lse, dout, dlse, *extras)
    kinds = _BWD_IN + tuple(extra_kinds)
    names = _BWD_NAMES + tuple(extra_kinds)
    grads = tuple(_wrapped(local_fn, kinds, _BWD_OUT + tuple(extra_out), names, seq_rule)(*args))
    if _explicit_mesh() is not None:
        # custom_vjp wants each gradient typed (sharded) exactly like its input.
        primals = (q, k, v) + tuple(x for x, kd in zip(extras, extra_kinds) if kd in extra_out)
        grads = tuple(jax.sharding.reshard(g, jax.typeof(x).sharding.spec) for g, x in zip(grads, primals))
    return grads
