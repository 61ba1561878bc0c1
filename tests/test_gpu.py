"""GPU-only checks of the CUDA kernels: sliced inputs, extreme lengths, long sequences,
CUDA graphs. Skipped without a GPU."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
import reference64
from conftest import CUDA_READY, random_inputs, run_with_command_buffers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA_READY, reason="needs a CUDA GPU and the CUDA kernels")]


def _gpu():
    return jax.devices("gpu")[0]


def _rel(a, b):
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_sliced_inputs():
    """Inputs that are slices/transposes of bigger arrays (non-contiguous views in the program)."""
    qkv, = random_inputs((2, 100, 3 * 8, 64), (1, 1, 1, 1), jnp.bfloat16, device=_gpu(), count=1)

    @jax.jit
    def f(qkv):
        q, k, v = qkv[:, 3:, :8], qkv[:, 1:, 8:16:2], qkv[:, 1:, 17::2]
        return jaxattn.flash_attention(q, k, v, is_causal=True, implementation="cuda"), (q, k, v)

    out, (q, k, v) = f(qkv)
    ref, _ = reference64.forward(q, k, v, scale=1 / 8, is_causal=True)
    assert _rel(out, ref) < 1e-2


# (H, B, T, N, causal): more query tiles than SMs, so each persistent CTA runs several
# tiles, on both sides of the forward's schedule rule (cuda/sm90/fwd_launch.cuh): the
# chained pingpong (non-causal; causal T <= 2048), the unchained pingpong (H=128 causal
# T > 2048), the three-warpgroup kernel (H=64 T >= 2048) and H=256 causal (persistent
# pairs at T <= 4096, the plain grid above). T not a multiple of 128.
_PERSISTENT_ROWS = [(64, 1, 1000, 40, False), (64, 1, 1000, 40, True), (64, 1, 2100, 20, False),
                    (128, 2, 2000, 8, False), (128, 2, 2000, 8, True), (128, 2, 2100, 8, True),
                    (256, 2, 2000, 16, True), (256, 1, 4200, 4, True)]


@pytest.mark.parametrize("H,B,T,N,causal", _PERSISTENT_ROWS)
def test_forward_persistent_tiles(H, B, T, N, causal):
    """The Hopper forward's persistent schedules with several tiles a CTA (the next tile's
    loads, Q buffers and epilogue overlapping this one's) against float64; on other GPUs
    the portable kernel runs the same shapes."""
    from test_forward import check_forward
    check_forward("cuda", B, T, T, N, max(N // 4, 1), H, jnp.bfloat16, causal)


@pytest.mark.parametrize("T,S", [(1, 1), (1, 4096), (4096, 1), (1, 77)])
def test_single_row_or_key(T, S):
    q, k, v = random_inputs((3, T, 8, 128), (3, S, 2, 128), jnp.bfloat16, device=_gpu())
    for causal in (False, True):
        out, lse = jaxattn.flash_attention(q, k, v, is_causal=causal, return_residual=True, implementation="cuda")
        ref, ref_lse = reference64.forward(q, k, v, scale=128 ** -0.5, is_causal=causal)
        assert _rel(out, ref) < 1e-2
        np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-3, atol=1e-3)


def test_128k_tokens_one_sequence():
    """T = S = 131072 in one sequence: checked on sampled rows against float64, gradients finite."""
    T, N, H = 131072, 2, 64
    q, k, v = random_inputs((1, T, N, H), (1, T, N, H), jnp.bfloat16, device=_gpu())
    rows = np.array([0, 1, 777, 65535, 100000, T - 1])
    for causal in (False, True):
        out, lse = jax.jit(lambda q, k, v: jaxattn.flash_attention(
            q, k, v, is_causal=causal, return_residual=True, implementation="cuda"))(q, k, v)
        ref, ref_lse = reference64.forward(q, k, v, scale=H ** -0.5, is_causal=causal, rows=rows)
        assert _rel(np.asarray(out, np.float32)[:, rows], ref) < 1e-2
        np.testing.assert_allclose(np.asarray(lse)[:, rows], ref_lse, rtol=1e-3, atol=1e-3)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jaxattn.flash_attention(q, k, v, is_causal=True).astype(jnp.float32)),
                         argnums=(0, 1, 2)))(q, k, v)
    for x in g:
        assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))


def _hopper_kernels() -> bool:
    return (_gpu().compute_capability == "9.0"
            and jaxattn._extension._jaxattn.cuda_forward_kernel(1, 64, 64, 4, 4, 64, True, 0, 9, 0) == "sm90")


def test_default_dispatch_on_gpu():
    q, k, v = random_inputs((1, 64, 4, 64), (1, 64, 4, 64), jnp.bfloat16, device=_gpu())
    assert jaxattn.kernel_for(q, k, v).startswith("cuda:")
    assert jaxattn.kernel_for(q, k, v, implementation="cuda_sm80") == "cuda:fwd=sm80,bwd=sm80"
    if _hopper_kernels():
        assert jaxattn.kernel_for(q, k, v) == "cuda:fwd=sm90,bwd=sm90"
        assert jaxattn.kernel_for(q, k, v, deterministic=True) == "cuda:fwd=sm90,bwd=sm90"
        # Head dims the Hopper kernels do not cover run on the portable ones.
        q96, k96, v96 = random_inputs((1, 64, 4, 96), (1, 64, 4, 96), jnp.bfloat16, device=_gpu())
        assert jaxattn.kernel_for(q96, k96, v96) == "cuda:fwd=sm80,bwd=sm80"
        q256, k256, v256 = random_inputs((1, 64, 4, 256), (1, 64, 4, 256), jnp.bfloat16, device=_gpu())
        assert jaxattn.kernel_for(q256, k256, v256) == "cuda:fwd=sm90,bwd=sm90"
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    assert jaxattn.kernel_for(q32, k32, v32) == "reference"
    # float32 on the GPU falls back to the reference, and still gives the right answer.
    out = jaxattn.flash_attention(q32, k32, v32)
    ref, _ = reference64.forward(q32, k32, v32, scale=1 / 8, is_causal=False)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("impl,H,causal", [("cuda", 128, False), ("cuda", 64, True), ("cuda_sm80", 128, True),
                                           ("cuda", 256, False)])
def test_deterministic_gradients_are_identical_bits(impl, H, causal):
    """deterministic=True: 10 runs give the same bits, and the same values as the default mode."""
    B, T, N, K = 2, 1100, 8, 2  # 9 key blocks add into every query block; GQA 4
    q, k, v, dout = random_inputs((B, T, N, H), (B, T, K, H), jnp.bfloat16, device=_gpu(), count=4)

    def grads(deterministic):
        def loss(q, k, v):
            out = jaxattn.flash_attention(q, k, v, is_causal=causal, implementation=impl,
                                          deterministic=deterministic)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    f = grads(True)
    first = [np.asarray(x).view(np.uint16) for x in f(q, k, v)]
    for _ in range(9):
        again = f(q, k, v)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, np.asarray(b).view(np.uint16))
    default = grads(False)(q, k, v)
    for a, b in zip(first, default):
        assert _rel(a.view(jnp.bfloat16).astype(np.float32), np.asarray(b, np.float64)) < 1e-2


_GRAPH_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, jaxattn
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (2, 256, 8, 64), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 256, 4, 64), jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 256, 4, 64), jnp.bfloat16)
    def loss(q, k, v):
        return jnp.sum(jaxattn.flash_attention(q, k, v, is_causal=True).astype(jnp.float32) ** 2)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    outs = [step(q, k, v) for _ in range(5)]
    jax.block_until_ready(outs)
    hlo = step.lower(q, k, v).compile().as_text()
    print("COMMAND_BUFFER" if "command_buffer" in hlo else "NO_COMMAND_BUFFER")
    vals = [float(o[0]) for o in outs]
    print("VALUES", vals)
""")


def test_runs_inside_cuda_graphs():
    """With XLA command buffers on for custom calls, the jitted fwd+bwd runs as a CUDA graph."""
    res = run_with_command_buffers(_GRAPH_SCRIPT)
    line = [l for l in res.stdout.splitlines() if l.startswith("VALUES")][0]
    vals = eval(line.split(" ", 1)[1])
    assert all(np.isfinite(vals)) and max(vals) - min(vals) <= 1e-3 * abs(vals[0]), vals
