"""Training steps of examples/train_lm.py's model on data, tensor and sequence parallel meshes.

Usage: python parallel_train_worker.py OUT.json [--gpu] [--steps N]

The same model, initial parameters, batches and optimizer run a few jitted
training steps on one device and on each mesh; every parallel run must
follow the single-device loss curve. The meshes (8 simulated CPU devices, or
with --gpu all the GPUs: the 1-D meshes over 2 of them):

* ``data``: the batch sharded, parameters replicated;
* ``tensor``: attention heads and the MLP's hidden units sharded (jaxattn's
  custom partitioning runs the kernel on each device's heads);
* ``sequence``: the tokens sharded along the sequence (jaxattn runs ring
  attention over that axis, causal load-balanced);
* ``data_tensor_sequence`` (CPU only, 2 x 2 x 2): all three at once.

Parallelism comes from shardings alone (``jax.device_put`` with
NamedShardings, then plain ``jax.jit``): XLA's partitioner splits the model and
calls jaxattn's partitioning rules for attention. Each run records its losses,
the largest relative difference from the single-device losses, and which
collectives the compiled step holds (a sequence mesh must hold
collective-permutes: the ring). Results go to OUT.json as
``{name: {"ok", "detail", ...}}``, like the other workers.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

GPU = "--gpu" in sys.argv
if not GPU:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import train_lm  # noqa: E402

# Model and run sizes. GPU: head_dim 64 and bf16 so that the CUDA kernels run.
CONFIG = {
    "cpu": dict(layers=2, d_model=64, heads=4, kv_heads=2, seq_len=64, batch=8, dtype="float32", rtol=2e-4),
    "gpu": dict(layers=2, d_model=512, heads=8, kv_heads=4, seq_len=2048, batch=8, dtype="bfloat16",
                rtol=2e-2),
}
_COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")


def _tensor_spec(path: str, ndim: int):
    """The tensor-parallel sharding of one parameter (by its path in the model)."""
    if "query_kernel" in path or "key_kernel" in path or "value_kernel" in path:
        return P(None, "tensor", None)  # [embed, heads, head_dim]
    if "out_kernel" in path:
        return P("tensor", None, None)  # [heads, head_dim, embed]
    if "['up']" in path:
        return P(None, "tensor")  # [d, 4d]
    if "['down']" in path:
        return P("tensor", None)  # [4d, d]
    return P()


def _param_shardings(mesh, params):
    tensor = "tensor" in mesh.axis_names
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, _tensor_spec(jax.tree_util.keystr(path), x.ndim) if tensor else P()),
        params)


def _token_sharding(mesh):
    names = mesh.axis_names
    return NamedSharding(mesh, P("data" if "data" in names else None, "sequence" if "sequence" in names else None))


def _setup(cfg):
    dtype = jnp.dtype(cfg["dtype"])
    model = train_lm.LM(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["kv_heads"], dtype, None, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, b2=0.95, weight_decay=0.1))

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = train_lm.load_text(None, 400_000)
    it = train_lm.batches(data, cfg["batch"], cfg["seq_len"], seed=0)
    return params, optimizer, jax.jit(step), it


def run(mesh, cfg, steps: int, batches, params0, optimizer, step):
    """(losses, collectives in the compiled step, seconds per step after the first)."""
    if mesh is None:
        dev = jax.devices()[0]
        p_sh, tok = jax.tree.map(lambda _: dev, params0), dev
    else:
        p_sh, tok = _param_shardings(mesh, params0), _token_sharding(mesh)
    params = jax.device_put(params0, p_sh)
    opt_state = jax.jit(optimizer.init)(params)
    xs = [(jax.device_put(x, tok), jax.device_put(y, tok)) for x, y in batches]
    text = step.lower(params, opt_state, *xs[0]).compile().as_text()
    collectives = sorted({m.group(1) for m in _COLLECTIVES.finditer(text)})
    losses, t0 = [], None
    for i, (x, y) in enumerate(xs[:steps]):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
        if i == 0:
            t0 = time.perf_counter()
    per_step = (time.perf_counter() - t0) / max(steps - 1, 1)
    return losses, collectives, per_step, text


def meshes(gpu: bool):
    devs = jax.devices()
    if gpu:
        return {name: Mesh(np.array(devs), (name,)) for name in ("data", "tensor", "sequence")}
    two = np.array(devs[:2])
    return {
        "data": Mesh(two, ("data",)),
        "tensor": Mesh(two, ("tensor",)),
        "sequence": Mesh(two, ("sequence",)),
        "data_tensor_sequence": Mesh(np.array(devs[:8]).reshape(2, 2, 2), ("data", "tensor", "sequence")),
    }


def main():
    args = [a for a in sys.argv[1:] if a != "--gpu"]
    out_path = args[0]
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 4
    if GPU:
        assert len(jax.devices("gpu")) >= 2, f"--gpu needs 2+ GPUs, got {jax.devices()}"
    cfg = CONFIG["gpu" if GPU else "cpu"]
    params0, optimizer, step, it = _setup(cfg)
    batches = [next(it) for _ in range(steps)]
    results = {}
    single, _, single_s, _ = run(None, cfg, steps, batches, params0, optimizer, step)
    results["single"] = {"ok": all(np.isfinite(single)), "detail": f"losses {single}", "losses": single,
                         "seconds_per_step": single_s}
    print(f"single: {single}", flush=True)
    for name, mesh in meshes(GPU).items():
        try:
            losses, colls, secs, text = run(mesh, cfg, steps, batches, params0, optimizer, step)
            rel = float(np.max(np.abs(np.array(losses) - np.array(single)) / np.abs(np.array(single))))
            ok = rel <= cfg["rtol"] and all(np.isfinite(losses))
            detail = f"max relative loss difference {rel:.2e} (bound {cfg['rtol']}); collectives {colls}"
            if "sequence" in mesh.axis_names and "collective-permute" not in colls:
                ok, detail = False, detail + "; no collective-permute: the ring did not run"
            kernel = "jaxattn_cuda" if GPU else "jaxattn_cpu"
            if kernel not in text:
                ok, detail = False, detail + f"; no {kernel} call in the compiled step"
            results[name] = {"ok": bool(ok), "detail": detail, "losses": losses, "max_rel_diff": rel,
                             "collectives": colls, "seconds_per_step": secs}
        except Exception:  # noqa: BLE001
            results[name] = {"ok": False, "detail": traceback.format_exc()[-3000:]}
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAIL'} {results[name]['detail'][:300]}", flush=True)
    with open(out_path, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
