"""The three forms of a batch's LoRA deltas, per decoder projection of Llama-3.1-8B, against the projection itself.

For T tokens spread over the adapters, each form computes y[t] = B[s_t] @ (A[s_t] @ x[t]) with A f[S, r, in] and
B f[S, out, r] (S = --adapters + 1 slots, slot 0 empty):

    onehot  what the engine runs (model/lora.py `lora_delta`): every token times every slot's A, the other slots
            masked, one contraction with all of B; reads every slot's weights whatever the batch uses
    gather  the reference form (`lora_delta_by_gather`): each token's own A and B gathered into f[T, r, in] and
            f[T, out, r], then contracted
    pallas  the Pallas kernels (kernels_pallas/lora_bgmv.py): one program per token reads only its adapter
            (GPU only; --interpret runs them on any backend, slowly, for a smoke test)
    base    the projection alone, x @ W.T with W f[out, in]: what the delta adds to

Per (projection, T): median seconds per call (reps of back-to-back calls blocked once, the forms alternated rep by
rep, as benchmarks/kernels.py times kernels), each form against `base`, and the bytes of adapter weights the batch
needs (the adapters its tokens use) over the copy bandwidth measured in the same run. Tokens cycle over adapters
1..N (every token adapted); `--base-share` of them take slot 0 instead. Each form's output is checked against the
gather form once (max abs error in the JSON).

    python benchmarks/lora_kernels.py --out lora_kernels.json                # a GPU
    python benchmarks/lora_kernels.py --smoke --out smoke.json               # CPU: tiny shapes, kernels interpreted
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.lora import lora_delta, lora_delta_by_gather
from kernels import calls_per_rep, measure_copy_bandwidth, seconds_per_call
from kernels_pallas.lora_bgmv import BgmvTuning, lora_bgmv
from bench_machine import machine_description

LLAMA_8B_PROJECTIONS = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "gate_proj": (4096, 14336),
                        "down_proj": (14336, 4096)}  # (in, out)
SMOKE_PROJECTIONS = {"q_proj": (64, 64), "gate_proj": (64, 128)}
FORMS = ("base", "onehot", "gather", "pallas")
SMOKE_TUNING = BgmvTuning(in_block=32, out_block=32)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--adapters", type=int, default=4, help="adapter slots besides slot 0")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--base-share", type=float, default=0.0, help="share of tokens on the base model (slot 0)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--interpret", action="store_true", help="run the Pallas kernels interpreted (any backend)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few reps, kernels interpreted (CPU)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    parser.add_argument("--plot", type=Path, default=None, help="PNG (default: --out with .png)")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.reps, args.interpret, args.dtype = [1, 8], 2, True, "float32"
    return args


def operands(projection: tuple[int, int], tokens: int, args: argparse.Namespace, seed: int) -> tuple:
    """x f[T, in], a f[S, r, in], b f[S, out, r], token_slots i32[T], w f[out, in]."""
    width, out = projection
    keys = jax.random.split(jax.random.key(seed), 4)
    dtype, slots = jnp.dtype(args.dtype), args.adapters + 1
    x = jax.random.normal(keys[0], (tokens, width), dtype)
    a = (0.05 * jax.random.normal(keys[1], (slots, args.rank, width), dtype)).at[0].set(0)
    b = (0.05 * jax.random.normal(keys[2], (slots, out, args.rank), dtype)).at[0].set(0)
    w = 0.02 * jax.random.normal(keys[3], (out, width), dtype)
    adapted = 1 + np.arange(tokens) % args.adapters
    on_base = np.random.default_rng(seed).random(tokens) < args.base_share
    token_slots = jnp.asarray(np.where(on_base, 0, adapted), jnp.int32)
    return x, a, b, token_slots, w


def forms(args: argparse.Namespace, on_gpu: bool) -> dict[str, Callable]:
    """Each form as a jitted callable of (x, a, b, token_slots, w); pallas only where it can run."""
    tuning = SMOKE_TUNING if args.smoke else BgmvTuning()
    chosen = {"base": jax.jit(lambda x, a, b, s, w: jnp.einsum("ti,oi->to", x, w)),
              "onehot": jax.jit(lambda x, a, b, s, w: lora_delta(x, a, b, s)),
              "gather": jax.jit(lambda x, a, b, s, w: lora_delta_by_gather(x, a, b, s))}
    if on_gpu or args.interpret:
        chosen["pallas"] = jax.jit(lambda x, a, b, s, w: lora_bgmv(x, a, b, s, tuning=tuning,
                                                                    interpret=args.interpret))
    return chosen


def adapter_bytes(token_slots: jax.Array, a: jax.Array, b: jax.Array) -> int:
    """Bytes of the adapters the batch's tokens use (each read once): what a form must read at least."""
    used = len(set(np.asarray(token_slots).tolist()) - {0})
    return used * (a[0].nbytes + b[0].nbytes)


def measure_point(projection: tuple[int, int], tokens: int, args: argparse.Namespace,
                  callables: dict[str, Callable], copy_bytes_per_s: float) -> dict[str, Any]:
    arguments = operands(projection, tokens, args, seed=tokens)
    reference = np.asarray(callables["gather"](*arguments), np.float32)
    errors = {name: float(np.abs(np.asarray(run(*arguments), np.float32) - reference).max())
              for name, run in callables.items() if name != "base"}
    calls = {name: calls_per_rep(lambda n, run=run: seconds_per_call(run, [arguments], n), warmup=3)
             for name, run in callables.items()}
    times: dict[str, list[float]] = {name: [] for name in callables}
    names = list(callables)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # the starting form rotates
            times[name].append(seconds_per_call(callables[name], [arguments], calls[name]))
    median = {name: statistics.median(t) for name, t in times.items()}
    needed = adapter_bytes(arguments[3], arguments[1], arguments[2])
    return {"tokens": tokens, "median_s": median, "times_s": times, "max_abs_error_vs_gather": errors,
            "vs_base": {name: median[name] / median["base"] for name in median if name != "base"},
            "adapter_bytes": needed,
            "fraction_of_copy_bandwidth": {name: needed / median[name] / copy_bytes_per_s
                                           for name in median if name != "base"}}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib  # here: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    projections = results["projections"]
    figure, axes = plt.subplots(1, len(projections), figsize=(5 * len(projections), 4), squeeze=False)
    for axis, (name, points) in zip(axes[0], projections.items()):
        tokens = [p["tokens"] for p in points]
        for form in points[0]["median_s"]:
            axis.plot(tokens, [p["median_s"][form] * 1e6 for p in points], marker="o", label=form)
        axis.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per call", title=name)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    on_gpu = jax.default_backend() == "gpu"
    copy = measure_copy_bandwidth(1 << (20 if args.smoke else 30), args.dtype, reps=3 if args.smoke else 7,
                                  warmup=1)
    callables = forms(args, on_gpu)
    shapes = SMOKE_PROJECTIONS if args.smoke else LLAMA_8B_PROJECTIONS
    results = {"machine": machine_description(), "settings": {k: str(v) for k, v in vars(args).items()},
               "copy_bytes_per_s": copy["bytes_per_s"], "projections": {}}
    for name, projection in shapes.items():
        results["projections"][name] = [measure_point(projection, t, args, callables, copy["bytes_per_s"])
                                        for t in args.tokens]
        for point in results["projections"][name]:
            cells = "  ".join(f"{form} {point['median_s'][form] * 1e6:8.1f}" for form in point["median_s"])
            print(f"{name:10s} T={point['tokens']:5d}  us: {cells}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
        plot(results, args.plot or args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
