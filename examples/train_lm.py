"""Train a small byte-level decoder-only language model on jaxattn's flax.nnx attention layer.

The default text is this Python's own standard library sources (every
install has them); pass --data for your own. Needs flax and optax
(``pip install jaxattn[flax]``); matplotlib, when present, draws the loss curve.

    python examples/train_lm.py                         # CPU preset, ~2-3 minutes on 2 cores
    python examples/train_lm.py --attention xla         # the same model on jax.nn.dot_product_attention
    python examples/train_lm.py --preset gpu --attention cudnn
    python examples/train_lm.py --data book.txt --steps 1000 --save lm.npz
    python examples/train_lm.py --restore lm.npz --steps 0   # just sample from a checkpoint

Several devices: the batch is split over a 1-D ("data",) mesh of all devices
and gradients are averaged (data parallelism, parameters replicated).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxattn
from jaxattn.flax.nnx import MultiHeadAttention

PRESETS = {
    # For tests: seconds.
    "tiny": dict(layers=1, d_model=32, heads=4, kv_heads=2, seq_len=64, batch=16, steps=5,
                 lr=3e-3, dtype="float32", data_bytes=200_000),
    # ~2-3 minutes on a 2-core CPU.
    "cpu": dict(layers=4, d_model=128, heads=4, kv_heads=2, seq_len=128, batch=32, steps=250,
                lr=2e-3, dtype="float32", data_bytes=4_000_000),
    # A few minutes on one modern GPU.
    "gpu": dict(layers=8, d_model=512, heads=8, kv_heads=4, seq_len=1024, batch=32, steps=1000,
                lr=1e-3, dtype="bfloat16", data_bytes=40_000_000),
}
VOCAB = 256  # bytes


# ----------------------------------------------------------------------------- data

def load_text(path: str | None, max_bytes: int) -> np.ndarray:
    """uint8 bytes of `path`, or of this Python's standard-library sources (sorted, deterministic)."""
    if path:
        with open(path, "rb") as f:
            data = f.read(max_bytes)
    else:
        root = os.path.dirname(os.__file__)
        chunks, total = [], 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
            for name in sorted(filenames):
                if name.endswith(".py") and total < max_bytes:
                    with open(os.path.join(dirpath, name), "rb") as f:
                        chunks.append(f.read())
                    total += len(chunks[-1])
        data = b"".join(chunks)[:max_bytes]
    if len(data) < 1024:
        raise SystemExit(f"not enough text: {len(data)} bytes")
    return np.frombuffer(data, np.uint8)


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int):
    """Endless (inputs, targets) int32 [batch, seq_len] pairs at random offsets."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, batch)
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        window = data[idx].astype(np.int32)
        yield window[:, :-1], window[:, 1:]


# ----------------------------------------------------------------------------- model

class Block(nnx.Module):
    """Pre-norm transformer block: causal rotary self-attention, then a GELU MLP."""

    def __init__(self, d_model, heads, kv_heads, dtype, attention_fn, rngs):
        self.norm1 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = MultiHeadAttention(d_model, heads, num_kv_heads=kv_heads, is_causal=True,
                                       rope_theta=10_000.0, dtype=dtype, attention_fn=attention_fn,
                                       rngs=rngs)
        self.norm2 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LM(nnx.Module):
    """Byte-level decoder-only transformer with tied input/output embeddings."""

    def __init__(self, layers, d_model, heads, kv_heads, dtype, attention_fn, rngs):
        self.embed = nnx.Embed(VOCAB, d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, kv_heads, dtype, attention_fn, rngs)
                                for _ in range(layers)])
        self.norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)  # [B, T, VOCAB] logits


def attention_for(name: str):
    """The attention_fn(q, k, v, is_causal=...) behind --attention."""
    if name == "jaxattn":
        return None  # the layer's default: jaxattn.flash_attention
    return functools.partial(jax.nn.dot_product_attention, implementation=name)


# ----------------------------------------------------------------------------- checkpoints

def save_params(path: str, params) -> None:
    """Params as a NumPy .npz, one array per parameter path."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})


def restore_params(path: str, params):
    """Params of the same model from a save_params .npz (shapes and names must match)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    with np.load(path) as f:
        missing = [jax.tree_util.keystr(k) for k, _ in leaves if jax.tree_util.keystr(k) not in f]
        if missing:
            raise SystemExit(f"{path} does not fit this model: no {missing[:3]}...")
        new = [jnp.asarray(f[jax.tree_util.keystr(k)], v.dtype) for k, v in leaves]
    for (k, v), n in zip(leaves, new):
        if v.shape != n.shape:
            raise SystemExit(f"{path}: {jax.tree_util.keystr(k)} has shape {n.shape}, the model {v.shape}")
    return jax.tree_util.tree_unflatten(treedef, new)


# ----------------------------------------------------------------------------- reporting

class Progress:
    """A plain-text progress bar on stderr (one line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int):
        self.total, self.tty, self.last = max(total, 1), sys.stderr.isatty(), -1

    def update(self, step: int, text: str) -> None:
        frac = step / self.total
        if self.tty:
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            print(f"\r[{bar}] {step}/{self.total} {text}", end="", file=sys.stderr, flush=True)
        elif int(10 * frac) != self.last or step == self.total:
            self.last = int(10 * frac)
            print(f"step {step}/{self.total} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def timed(fn, *args, reps: int = 5, calls: int = 10) -> float:
    """Median seconds of a jitted call, after a compiling warm-up.

    Each sample runs `calls` calls back to back and syncs once, so host
    dispatch overlaps device work as it does inside a training step.
    """
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


def attention_seconds(attention_fn, batch, seq_len, heads, kv_heads, head_dim, dtype) -> float:
    """Seconds of one jitted causal attention forward+backward at one layer's per-device shapes."""
    attn = attention_fn or jaxattn.flash_attention
    kq, kk, kv, kd = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(kq, (batch, seq_len, heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, seq_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, seq_len, kv_heads, head_dim), dtype)
    dout = jax.random.normal(kd, q.shape, dtype)
    loss = lambda q, k, v: jnp.vdot(attn(q, k, v, is_causal=True).astype(jnp.float32),
                                    dout.astype(jnp.float32))
    return timed(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), q, k, v)


def plot_losses(path: str, losses: list[float], attention: str) -> None:
    """The training-loss curve as a PNG, when matplotlib is installed (else a note)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss-curve plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/byte)")
    ax.set_title(f"train_lm.py, attention: {attention}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve: {path}")


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model and run sizes (default: cpu; tiny is for tests)")
    parser.add_argument("--attention", choices=["jaxattn", "cudnn", "xla"], default="jaxattn")
    parser.add_argument("--data", help="a text file to train on (default: the Python standard library)")
    for name in ("layers", "d_model", "heads", "kv_heads", "seq_len", "batch", "steps", "data_bytes"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="overrides the preset")
    parser.add_argument("--lr", type=float, help="peak learning rate (overrides the preset)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write the trained params to this .npz")
    parser.add_argument("--restore", help="start from the params in this .npz")
    parser.add_argument("--plot", default="train_lm_loss.png", help="loss-curve PNG ('' for none)")
    parser.add_argument("--sample", type=int, default=300, help="bytes to sample at the end")
    parser.add_argument("--prompt", default="def ")
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def make_steps(graphdef, optimizer, mesh):
    """Jitted (train_step, eval_loss), data parallel over the mesh's "data" axis.

    Each device runs the model on its slice of the batch (shard_map) and the
    loss and gradients are averaged across devices; parameters and optimizer
    state are replicated.
    """

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def local_grads(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")

    # check_vma=False: jaxattn's ffi_calls do not (yet) mark their outputs as
    # varying over the mesh axis, which shard_map's checker would reject.
    per_device = functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                   check_vma=False)
    sharded_grads = per_device(local_grads, out_specs=(P(), P()))
    sharded_loss = per_device(lambda p, x, y: jax.lax.pmean(loss_fn(p, x, y), "data"), out_specs=P())

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y):
        loss, grads = sharded_grads(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, jax.jit(sharded_loss)


def train(train_step, params, opt_state, batch_iter, steps: int, put):
    """Runs `steps` steps; returns (params, losses, tokens/s, seconds/step), timing from step 2 on."""
    losses, tokens, seconds = [], 0, 0.0
    progress = Progress(steps)
    for step, (x, y) in zip(range(1, steps + 1), batch_iter):
        t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, put(x), put(y))
        loss = float(loss)  # waits for the step
        if step > 1:  # step 1 compiles
            seconds += time.perf_counter() - t0
            tokens += x.size
        losses.append(loss)
        if not math.isfinite(loss):
            progress.close()
            raise SystemExit(f"loss is {loss} at step {step}")
        progress.update(step, f"loss {loss:.3f} " + (f"{tokens / seconds:,.0f} tok/s" if seconds else "compiling"))
    progress.close()
    rate = tokens / seconds if seconds else float("nan")
    return params, losses, rate, seconds / (steps - 1) if steps > 1 else float("nan")


def main(argv=None) -> dict:
    """Trains, reports and samples; returns {"losses", "tokens_per_s", "attention_share", ...}."""
    args = parse_args(argv)
    if args.attention == "cudnn" and jax.default_backend() != "gpu":
        raise SystemExit("--attention cudnn needs a CUDA GPU")
    dtype = jnp.dtype(args.dtype)
    head_dim = args.d_model // args.heads
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
    batch = math.ceil(args.batch / len(devices)) * len(devices)  # divisible by the mesh
    split = NamedSharding(mesh, P("data"))
    put = lambda a: jax.device_put(a, split)

    data = load_text(args.data, args.data_bytes)
    cut = int(0.95 * len(data))
    attention_fn = attention_for(args.attention)
    model = LM(args.layers, args.d_model, args.heads, args.kv_heads, dtype, attention_fn,
               nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    if args.restore:
        params = restore_params(args.restore, params)

    kernel = ""
    if args.attention == "jaxattn":
        q = jax.ShapeDtypeStruct((1, args.seq_len, args.heads, head_dim), dtype)
        kv = jax.ShapeDtypeStruct((1, args.seq_len, args.kv_heads, head_dim), dtype)
        kernel = f" ({jaxattn.kernel_for(q, kv, kv, is_causal=True)})"
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}; "
          f"attention: {args.attention}{kernel}")
    print(f"model: {args.layers} layers, d={args.d_model}, {args.heads} heads ({args.kv_heads} kv), "
          f"T={args.seq_len}, {n_params / 1e6:.2f}M params, {dtype.name}; batch {batch}, "
          f"{len(data) / 1e6:.1f} MB of {'text from ' + args.data if args.data else 'Python stdlib sources'}")

    warmup = max(1, min(100, args.steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1),
                                                  end_value=args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b2=0.95, weight_decay=0.1))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    train_step, eval_loss = make_steps(graphdef, optimizer, mesh)

    t_start = time.perf_counter()
    params, losses, tokens_per_s, step_s = train(
        train_step, params, opt_state, batches(data[:cut], batch, args.seq_len, args.seed),
        args.steps, put)
    result = {"losses": losses, "tokens_per_s": tokens_per_s, "attention_share": float("nan")}
    if args.steps:
        vx, vy = next(batches(data[cut:], batch, args.seq_len, args.seed + 1))
        result["val_loss"] = float(eval_loss(params, put(vx), put(vy)))
        print(f"{args.steps} steps in {time.perf_counter() - t_start:.1f} s: train loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f}, held-out loss {result['val_loss']:.3f} nats/byte; "
              f"{tokens_per_s:,.0f} tokens/s")
    if args.steps > 1:
        attn_s = args.layers * attention_seconds(attention_fn, batch // len(devices), args.seq_len,
                                                 args.heads, args.kv_heads, head_dim, dtype)
        result["attention_share"] = attn_s / step_s
        print(f"attention share of a step: {100 * attn_s / step_s:.0f}% "
              f"({args.layers} layers x {1e3 * attn_s / args.layers:.2f} ms attention fwd+bwd, "
              f"step {1e3 * step_s:.1f} ms)")

    if args.plot and losses:
        plot_losses(args.plot, losses, args.attention)
    if args.save:
        save_params(args.save, jax.device_get(params))
        print(f"params saved to {args.save}")
    if args.sample:
        result["sample"] = sample(graphdef, params, args)
        print(f"--- sample ({args.sample} bytes after {args.prompt!r}) ---\n{result['sample']}\n---")
    return result


def sample(graphdef, params, args, temperature: float = 0.8) -> str:
    """Bytes sampled one at a time; the model sees the last seq_len bytes (no KV cache)."""

    @jax.jit
    def next_byte(params, window, pos, key):
        logits = nnx.merge(graphdef, params)(window[None])[0, pos]
        return jax.random.categorical(key, logits / temperature)

    tokens = list(args.prompt.encode())
    key = jax.random.key(args.seed)
    for _ in range(args.sample):
        window = tokens[-args.seq_len:]
        pos = len(window) - 1
        padded = np.zeros(args.seq_len, np.int32)
        padded[:len(window)] = window
        key, sub = jax.random.split(key)
        tokens.append(int(next_byte(params, padded, pos, sub)))
    return bytes(tokens).decode("utf-8", errors="replace")


if __name__ == "__main__":
    main()
