"""Tiny pre-quantized FP8 Llama checkpoints in the exact layouts vLLM users download, and transformers' reading of
them: the oracle jaxserve's loader is checked against. Needs the parity extra (torch, transformers, accelerate,
compressed-tensors); callers skip without it.

  - compressed-tensors checkpoints are written by compressed-tensors itself, as llm-compressor drives it: its
    quantization config applied to a tiny HF Llama, its `calculate_qparams` turning each weight's min and max (per
    tensor, channel or block; the observers that collect them live in llm-compressor) into scales, its compressor
    casting the weights to float8 and writing config.json.
  - transformers' fp8 (block) checkpoints: the HF model saved, then each decoder projection replaced by its float8
    weight and `weight_scale_inv`, quantized the way transformers' `Fp8Quantize` does (scale = block max / 448),
    and config.json given the `quantization_config` Qwen3-*-FP8 repositories carry.
  - `transformers_dequantized` loads either with transformers on CPU, dequantized (`CompressedTensorsConfig(
    run_compressed=False)`, `FineGrainedFP8Config(dequantize=True)`): transformers' own reading of the format. That
    model multiplies unquantized activations (W8A16); `quantize_inputs_as_compressed_tensors` makes it W8A8, each
    decoder projection's input fake-quantized by compressed-tensors' own code as the checkpoint's scheme says.

`vary_block_magnitudes` first scales each 16x16 block of every projection by 1/2, 1 or 2, so that neighbouring
blocks (and channels) get very different scales: a scale applied to the wrong block, transposed, or per input
channel changes the logits far beyond the tests' tolerance.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

PROJECTION_SUFFIX = "proj.weight"  # the decoder's linear layers (q/k/v/o, gate/up/down); lm_head is left alone
_VARIED_BLOCK = 16
_FP8_MAX = 448.0  # largest float8_e4m3fn value


def vary_block_magnitudes(model, seed: int = 0):
    """`model` with each 16x16 block of each decoder projection multiplied by 2**k, k in {-1, 0, 1} (in place)."""
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(PROJECTION_SUFFIX) and ".layers." in name:
                rows, columns = (-(-size // _VARIED_BLOCK) for size in param.shape)
                factors = 2.0 ** rng.integers(-1, 2, size=(rows, columns))
                full = np.repeat(np.repeat(factors, _VARIED_BLOCK, 0), _VARIED_BLOCK, 1)  # f64[>= out, >= in]
                param.mul_(torch.tensor(full[:param.shape[0], :param.shape[1]], dtype=param.dtype))
    return model


def save_compressed_tensors(model, folder: Path, strategy: str, block: tuple[int, int] | None = None,
                            inputs: str | None = "static", kv_cache: bool = False) -> None:
    """A compressed-tensors FP8 checkpoint of (a copy of) `model`: weights per `strategy` ("tensor", "channel" or
    "block" of `block`), input activations "static" (per-tensor `input_scale`), "dynamic" (per token) or None
    (weight-only), a kv_cache_scheme when `kv_cache`; lm_head ignored, as llm-compressor's FP8 recipes do."""
    import torch
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = copy.deepcopy(model)
    fp8 = dict(num_bits=8, type="float", symmetric=True)
    weights = QuantizationArgs(**fp8, strategy=strategy, dynamic=False,
                               **({"block_structure": list(block)} if block else {}))
    activations = None if inputs is None else QuantizationArgs(
        **fp8, strategy="tensor" if inputs == "static" else "token", dynamic=inputs != "static")
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                                     input_activations=activations)},
        ignore=["lm_head"], kv_cache_scheme=QuantizationArgs(**fp8, strategy="tensor") if kv_cache else None)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                low, high = _min_max(module.weight, strategy, block)
                scale, _ = calculate_qparams(low, high, weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "input_scale"):  # a calibration's result; jaxserve checks it is there
                    module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def _min_max(weight, strategy: str, block: tuple[int, int] | None):
    """Each scale's (min, max) over its part of weight [out, in], as llm-compressor's min-max observer gathers
    them: one pair, one per output channel ([out, 1]), or one per block (zero-padded partial blocks)."""
    from compressed_tensors.quantization.utils.helpers import maybe_pad_tensor_for_block_quant

    if strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if strategy == "channel":
        return weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    padded = maybe_pad_tensor_for_block_quant(weight, block)
    blocks = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def save_transformers_fp8(model, folder: Path, block: tuple[int, int]) -> None:
    """A transformers fp8 checkpoint of `model`: float8 projections with f32 `weight_scale_inv` per `block` (which
    must divide every projection, as transformers' quantizer requires)."""
    import torch

    model.save_pretrained(folder)
    edit_tensors(folder, lambda tensors: tensors.update(
        {scaled: value for name, weight in list(tensors.items()) if _is_projection(name)
         for scaled, value in _fp8_block_quantized(name, weight, block, torch).items()}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _is_projection(name: str) -> bool:
    return ".layers." in name and name.endswith(PROJECTION_SUFFIX)


def _fp8_block_quantized(name: str, weight, block: tuple[int, int], torch) -> dict:
    """{name: float8 weight, name_scale_inv: f32[out blocks, in blocks]}, as transformers' Fp8Quantize computes
    them: each block divided by (its largest magnitude / 448)."""
    rows, columns = block
    out_blocks, in_blocks = weight.shape[0] // rows, weight.shape[1] // columns
    blocks = weight.float().reshape(out_blocks, rows, in_blocks, columns)  # f32[out blocks, rows, in blocks, columns]
    scale_inv = blocks.abs().amax(dim=(1, 3)) / _FP8_MAX  # f32[out blocks, in blocks]
    quantized = (blocks / scale_inv[:, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return {name: quantized.reshape(weight.shape), name + "_scale_inv": scale_inv}


def edit_tensors(folder: Path, change: Callable[[dict], None]) -> None:
    """Rewrite the folder's model.safetensors after `change` edits its tensor dict (name -> torch tensor) in place."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def transformers_dequantized(folder: Path):
    """transformers' float32 model of a pre-quantized checkpoint, its weights dequantized as it reads them."""
    import torch
    import transformers

    method = json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"]
    quantization = (transformers.FineGrainedFP8Config(dequantize=True) if method == "fp8"
                    else transformers.CompressedTensorsConfig(run_compressed=False))
    with warnings.catch_warnings():  # that the loading settings passed override the config's: they are meant to
        warnings.simplefilter("ignore", UserWarning)
        return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization,
                                                                 dtype=torch.float32).eval()


def quantize_inputs_as_compressed_tensors(model, folder: Path):
    """`model` (transformers_dequantized of a compressed-tensors checkpoint in `folder`) with every decoder
    projection's input quantized to float8 and back before its matmul, as the checkpoint's `input_activations`
    scheme says: compressed-tensors computes each dynamic scale (per token or tensor) and rounds, and a static
    scheme uses the projection's stored `input_scale`. Returns the model (hooked in place)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    [group] = config["config_groups"].values()
    args = QuantizationArgs(**group["input_activations"])
    stored = load_file(folder / "model.safetensors")

    def hook(name):
        def quantize_input(module, inputs):
            [x] = inputs
            if args.dynamic:
                scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
            else:
                scale, zero_point = stored[name + ".input_scale"].float(), None
            return (fake_quantize(x, scale, zero_point, args),)
        return quantize_input

    for name, module in model.named_modules():
        if ".layers." in name and name.endswith("proj"):
            module.register_forward_pre_hook(hook(name))
    return model
