"""Which kernel runs a call: the one rule, per platform, in one place.

`implementation=None` picks per platform at lowering time (through
jax.lax.platform_dependent): the CPU kernel on CPU; on CUDA GPUs the CUDA
kernels when they cover the call, else the pure-JAX reference; the reference
elsewhere. A forced implementation that cannot run the call raises
NotImplementedError naming why, so callers can fall back.

Masks on GPUs: local windows, per-batch lengths, segment ids and the soft cap
run on the Hopper kernels on an H100/H200 (both passes, deterministic mode
included); the dense bias / mask runs
on the portable (sm80) kernels on every GPU. The C++ side of this rule is
cuda::fwd_on_sm90 / bwd_on_sm90 in cuda/launch.h.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._extension import _jaxattn, built_with_cuda
from ._validation import AttentionSpec

CUDA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# The mask features the CUDA kernels do not take (AttentionSpec.mask_features
# names; such calls run the reference on GPUs): none since masks stage 3.
CUDA_UNSUPPORTED_MASKS: tuple[str, ...] = ()


def cuda_unsupported_reason(spec: AttentionSpec) -> str | None:
    """Why the CUDA kernels cannot run `spec`, or None when they can."""
    missing = [f for f in spec.mask_features() if f in CUDA_UNSUPPORTED_MASKS]
    if missing:
        return f"the CUDA kernels do not support {', '.join(missing)} yet"
    if not built_with_cuda():
        return "jaxattn was built without CUDA kernels (nvcc was not found at build time)"
    if spec.dtype not in CUDA_DTYPES:
        return f"the CUDA kernels take bfloat16 or float16, not {spec.dtype}"
    if spec.head_dim % 8 != 0:
        return f"the CUDA kernels need a head dim that is a multiple of 8, got {spec.head_dim}"
    return None


def _compute_capability() -> tuple[int, int]:
    """(major, minor) of the first CUDA device, or (0, 0) when there is none."""
    try:
        cc = jax.devices("gpu")[0].compute_capability
        major, minor = (int(x) for x in str(cc).split(".")[:2])
        return major, minor
    except Exception:
        return 0, 0


def cuda_kernel_name(spec: AttentionSpec, deterministic: bool = False) -> str:
    """The CUDA kernels that run `spec` (it must be supported), e.g. 'cuda:fwd=sm90,bwd=sm90'
    ('cuda:fwd=sm80,bwd=sm80' with a dense bias / mask)."""
    sizes = (spec.batch, spec.seqlen_q, spec.seqlen_k, spec.num_heads, spec.num_heads_k, spec.head_dim,
             spec.dtype in CUDA_DTYPES)
    cc = _compute_capability()
    fwd = _jaxattn.cuda_forward_kernel(*sizes, spec.mask_kind, *cc)
    bwd = _jaxattn.cuda_backward_kernel(*sizes, bool(deterministic), spec.mask_kind, *cc)
    return f"cuda:fwd={fwd},bwd={bwd}"


def kernel_for(spec: AttentionSpec, platform: str, deterministic: bool = False,
               implementation: str | None = None) -> str:
    """The kernel that runs `spec` on `platform` ('cpu', 'cuda' or 'gpu', ...) with
    `implementation` (None: the per-platform choice; a forced one must be able to run it)."""
    if implementation == "reference":
        return "reference"
    if implementation == "cpu":
        return "cpu:flash"
    if implementation == "cuda_sm80":
        return "cuda:fwd=sm80,bwd=sm80"
    if implementation == "cuda":
        return cuda_kernel_name(spec, deterministic)
    if platform == "gpu":  # jax.default_backend() says "gpu" for CUDA devices
        platform = "cuda"
    if platform == "cpu":
        return "cpu:flash"
    if platform == "cuda" and cuda_unsupported_reason(spec) is None:
        return cuda_kernel_name(spec, deterministic)
    return "reference"


def check_forced(spec: AttentionSpec, implementation: str | None) -> None:
    """Raises NotImplementedError when a forced implementation cannot run `spec`."""
    if implementation in ("cuda", "cuda_sm80"):
        reason = cuda_unsupported_reason(spec)
        if reason is not None:
            raise NotImplementedError(f"implementation={implementation!r} is unsupported here: {reason}")
