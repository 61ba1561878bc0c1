"""Names on the attention residuals, for ``jax.checkpoint`` (remat) policies.

Under ``jax.checkpoint`` the backward pass recomputes every value the policy
does not save. A policy saves values by name (``checkpoint_name``) or by the
primitive that made them (``dots_saveable`` and friends); a kernel's custom
call has neither, so without names each checkpointed layer runs the attention
forward kernel a second time in its backward pass (about 30% more attention
time in training) when the layers run in a loop (``lax.scan``); outside one,
XLA merges the two calls.

``flash_attention`` and ``ring_attention`` name the two values their backward
reads besides q, k and v: the output (``OUTPUT_NAME``, the value the caller
gets, so saving it also saves the forward's result for the layers after it)
and the logsumexp (``LSE_NAME``). A policy that saves both never re-runs the
forward kernel::

    policy = jax.checkpoint_policies.save_only_these_names(*jaxattn.CHECKPOINT_NAMES)
    layer = jax.checkpoint(layer, policy=policy)

or, with the usual matmul policy,
``jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable,
save_only_these_names(*jaxattn.CHECKPOINT_NAMES))``. JAX's offloading policy
``save_and_offload_only_these_names`` takes the same names (not tested here).
Saving them costs what the backward keeps anyway without remat: one q-shaped
array and B x T x N floats per call.
"""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

OUTPUT_NAME = "jaxattn_out"
LSE_NAME = "jaxattn_lse"
CHECKPOINT_NAMES = (OUTPUT_NAME, LSE_NAME)


def name_residuals(out, lse):
    """(out, lse) tagged with their checkpoint names (identity otherwise)."""
    return checkpoint_name(out, OUTPUT_NAME), checkpoint_name(lse, LSE_NAME)
