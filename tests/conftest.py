"""Shared fixtures: random inputs, the float64 reference, and the error bound."""

from __future__ import annotations

import os
import sys

# Several pytest-xdist workers share one GPU: none may preallocate 75% of its memory,
# or the later ones see no GPU and every GPU test skips (session 9 lost a device call
# to a bare `pytest -n 12`). Set before jax is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import jaxattn  # noqa: E402


def run_with_command_buffers(script: str, drop_env=()):
    """Runs `script` in a fresh Python with XLA command buffers (CUDA graphs) on for
    fusions and custom calls at every graph size, the variables `drop_env` unset.
    The script prints COMMAND_BUFFER or NO_COMMAND_BUFFER first (whether its compiled
    HLO holds a command buffer); both are asserted here. Returns the finished process."""
    import subprocess

    env = dict(os.environ)
    for name in drop_env:
        env.pop(name, None)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd="/")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "COMMAND_BUFFER" in res.stdout.split()[0], res.stdout
    return res


def run_worker(script: str, out: str, argv=None, *, gpu: bool = False, timeout: int = 1800) -> dict:
    """Runs a multi-device worker script (tests/*_worker.py: 8 simulated CPU devices,
    or with ``gpu`` the real GPUs, ``--gpu``) in a subprocess with the arguments
    `argv` (default: just `out`); returns the {check: {"ok", "detail", ...}} it
    wrote to `out`, or {"__error__": its output}."""
    import json
    import subprocess

    env = dict(os.environ)
    if gpu:  # this process may hold most of the GPU memory already
        env.pop("JAX_PLATFORMS", None)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
        env["JAX_PLATFORMS"] = "cpu"
    argv = [out] if argv is None else list(argv)
    proc = subprocess.run([sys.executable, script, *argv] + (["--gpu"] if gpu else []),
                          cwd=os.path.dirname(out), env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"__error__": proc.stdout[-4000:] + proc.stderr[-4000:]}
    with open(out) as fh:
        return json.load(fh)


def gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


HAS_GPU = has_gpu()
CUDA_READY = HAS_GPU and jaxattn.built_with_cuda()
gpu = pytest.mark.skipif(not CUDA_READY, reason="needs a CUDA GPU and jaxattn built with CUDA")

# Implementations under test: the compiled kernels of every platform present.
IMPLS = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu]),
         pytest.param("cuda_sm80", marks=[gpu, pytest.mark.gpu])]
HALF = (jnp.bfloat16, jnp.float16)
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def device_for(impl: str | None):
    if impl == "cpu":
        return jax.devices("cpu")[0]
    if impl in ("cuda", "cuda_sm80"):
        return jax.devices("gpu")[0]
    return jax.devices()[0]


def dtypes_for(impl: str):
    """The dtypes an implementation takes (the CUDA kernels are half-only)."""
    return HALF if impl in ("cuda", "cuda_sm80") else DTYPES


_counter = iter(range(10**9))


def random_inputs(shape_q, shape_kv, dtype, *, device=None, count=3, seed=None):
    """Fresh random normal arrays (never zeros): q, then key-shaped ones, then more q-shaped."""
    rng = np.random.default_rng(next(_counter) if seed is None else seed)
    shapes = [shape_q, shape_kv, shape_kv][:count] + [shape_q] * max(0, count - 3)
    arrs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    out = [jnp.asarray(a, dtype) for a in arrs]
    if device is not None:
        out = [jax.device_put(a, device) for a in out]
    return out


def plain_attention(q, k, v, *, scale, is_causal, mask=None, softcap=None, bias=None):
    """Attention computed by plain JAX entirely in the input dtype (the error yardstick).

    `mask`: optional bool [T, S], [B, T, S] or (rank 4) broadcastable to
    [B, N, T, S], of visible keys (ANDed with is_causal); rows with no visible
    key give 0. `softcap`: logits become softcap * tanh(logits / softcap),
    then `bias` (broadcastable to [B, N, T, S]) is added, before masking.
    """
    g = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(scale, q.dtype)
    if softcap is not None:
        c = jnp.asarray(softcap, q.dtype)
        s = c * jnp.tanh(s / c)
    if bias is not None:
        s = s + jnp.asarray(bias).astype(q.dtype)
    if is_causal:
        T, S = q.shape[1], k.shape[1]
        s = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(T)[:, None], s, -jnp.inf)
    if mask is not None:
        mask = jnp.asarray(mask)
        mask = {2: lambda m: m[None, None], 3: lambda m: m[:, None], 4: lambda m: m}[mask.ndim](mask)
        s = jnp.where(mask, s, -jnp.inf)
        empty = jnp.all(s == -jnp.inf, axis=-1, keepdims=True)
        s = jnp.where(empty, 0, s)  # no NaN: the row is zeroed below
        p = jnp.where(empty, 0, jax.nn.softmax(s, axis=-1))
    else:
        p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p.astype(q.dtype), v)


def max_err(x, ref) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref))) if np.size(ref) else 0.0


def floor_for(dtype, ref) -> float:
    """A small absolute floor: half an ulp of the dtype at max(1, largest |ref|) (inputs are O(1))."""
    scale = float(np.max(np.abs(ref))) if np.size(ref) else 0.0
    eps = 1e-5 if jnp.dtype(dtype) == jnp.float32 else float(jnp.finfo(dtype).eps) / 2
    return eps * max(scale, 1.0)


def assert_close(name, ours, plain, ref, dtype, allowance: float = 0.0):
    """FlashAttention's bound: our error <= 2x plain JAX's error in the same dtype + a floor.

    allowance: an error the algorithm makes by design, computed exactly for these
    inputs (reference64.backward's round_out: dbias through D from the rounded output)."""
    ours_np = np.asarray(ours.astype(jnp.float32))
    assert np.all(np.isfinite(ours_np)), f"{name}: non-finite values (unwritten or NaN output)"
    err = max_err(ours_np, ref)
    bound = 2 * max_err(np.asarray(plain.astype(jnp.float32)), ref) + floor_for(dtype, ref) + allowance
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


def poison_allocator(device, nbytes: int) -> None:
    """Fills freed device memory with NaN so an output element a kernel forgets to write shows.

    The allocator hands recently freed blocks to the next call, so the
    kernel's output buffers most likely start as these NaNs.
    """
    n = max(1, nbytes // 4)
    for _ in range(3):
        x = jax.device_put(jnp.full((n,), jnp.nan, jnp.float32), device)
        x.block_until_ready()
        del x
