"""FP8 accuracy, teacher-forced: what W8A8 (prefill steps), W8A16 (decode steps) and bf16 cost against transformers
reading the same FP8 checkpoint dequantized, in one run.

A tiny random Llama (transformers) is written as a compressed-tensors FP8_DYNAMIC checkpoint (float8 weights per
output channel, activations quantized per token at run time; the layout of the `-FP8-dynamic` repositories) by
compressed-tensors itself (tests/fp8_checkpoints.py). transformers loads it dequantized in float32: the reference.
jaxserve loads the same files and runs one prefill forward of each sequence (every position's logits) as:

    bf16        the dequantized weights as an unquantized bfloat16 model
    W8A16 bf16  float8 weights widened in the GEMM, bfloat16 activations: what decode steps run
    W8A8 bf16   float8 weights and activations quantized to float8 per token: what prefill and mixed steps run
    W8A8 f32    the same in float32 activations (isolates the activations' float8 rounding)

For each: mean |log-probability difference| of the sequence's next tokens against the reference, top-1 agreement
(the reference's likeliest token is jaxserve's too) at every position, and the logits' RMS error relative to the
reference logits' RMS (both centred per position). A random tiny model's
distributions are flatter than a trained model's, so agreement here is a lower bound of what trained models see.

    python benchmarks/fp8_accuracy.py --out fp8_accuracy.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_machine import machine_description  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=8, help="random sequences scored")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence (over 64: a W8A8 step)")
    parser.add_argument("--hidden", type=int, default=256, help="the tiny model's hidden size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    return parser.parse_args(argv)


def _model_variants(folder: Path) -> dict[str, Any]:
    """Mode name -> a LoadedModel of the checkpoint running that way."""
    import jax.numpy as jnp

    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.param_tree import abstract_params, fill_params, flat_arrays
    from jaxserve.checkpoint.quantize import dequantized_arrays
    from jaxserve.model.llama import projection_format

    variants = {}
    for dtype in ("bfloat16", "float32"):
        loaded = load_model(folder, dtype, progress=False)
        fmt = projection_format(_merged(loaded))
        weight_only = abstract_params(loaded.config, np.dtype(loaded.dtype), lambda name, shape: None,
                                      dataclasses.replace(fmt, activations=None))
        dense = abstract_params(loaded.config, np.dtype(loaded.dtype), lambda name, shape: None)
        short = "bf16" if dtype == "bfloat16" else "f32"
        variants[f"W8A8 {short}"] = loaded
        variants[f"W8A16 {short}"] = dataclasses.replace(loaded, graphdef=weight_only.graphdef)
        if dtype == "bfloat16":
            rebuilt = dequantized_arrays(flat_arrays(loaded.params), jnp.bfloat16)
            variants["bf16"] = dataclasses.replace(loaded, graphdef=dense.graphdef, params=fill_params(dense, rebuilt),
                                                   quantization=None)
    return variants


def _merged(loaded):
    from flax import nnx

    return nnx.merge(loaded.graphdef, loaded.params)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _scores(reference: np.ndarray, measured: np.ndarray, tokens: np.ndarray) -> dict[str, float]:
    """Mean |logprob difference| of each next token, and top-1 agreement, over every position but the last."""
    ref, got = _log_softmax(reference[:, :-1]), _log_softmax(measured[:, :-1])
    following = tokens[:, 1:, None]
    difference = np.abs(np.take_along_axis(ref, following, -1) - np.take_along_axis(got, following, -1))
    centered = reference - reference.mean(axis=-1, keepdims=True)
    error = (measured - measured.mean(axis=-1, keepdims=True)) - centered
    return {"mean_abs_logprob_difference": float(difference.mean()),
            "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
            "relative_logit_error": float(np.sqrt((error**2).mean() / (centered**2).mean()))}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tests.fp8_checkpoints import save_compressed_tensors, transformers_dequantized
    from tests.hf_models import build_tiny_hf_llama, hf_logits, jaxserve_logits

    hf = build_tiny_hf_llama("llama31", vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                             num_hidden_layers=args.layers)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, size=(args.sequences, args.length))
    with tempfile.TemporaryDirectory() as folder:
        save_compressed_tensors(hf, Path(folder), strategy="channel", inputs="dynamic")
        reference = hf_logits(transformers_dequantized(Path(folder)), tokens)
        modes = {name: _scores(reference, jaxserve_logits(loaded, tokens), tokens)
                 for name, loaded in _model_variants(Path(folder)).items()}
    return {"checkpoint": "compressed-tensors FP8_DYNAMIC (per-channel float8 weights, per-token activations)",
            "model": {"hidden": args.hidden, "layers": args.layers, "vocab": 512},
            "sequences": args.sequences, "length": args.length, "modes": modes}


def main(argv=None) -> None:
    args = parse_args(argv)
    result = {"machine": machine_description(), **measure(args)}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
