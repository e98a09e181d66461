"""Tiny 4-bit (W4A16) Llama checkpoints in the exact layouts vLLM users download, and their oracles. Needs the
parity extra; callers skip without it.

  - compressed-tensors `pack-quantized`, written by compressed-tensors itself as llm-compressor drives it (its
    quantization config applied to a tiny HF Llama, `calculate_qparams` turning each group's min and max into scales
    and zero points, its compressor packing the weights and writing config.json); transformers reads it back
    dequantized (tests/fp8_checkpoints.py `transformers_dequantized`).
  - AutoAWQ GEMM, packed here as AutoAWQ packs (its package pins an old transformers and does not install beside
    ours); the oracle is compressed-tensors' own AutoAWQConverter turning the files into pack-quantized ones, which
    transformers dequantizes: an independent reading of AWQ's interleaved nibbles and zero points.
  - GPTQ v1 and v2, packed here as GPTQModel packs (it does not build here); the oracle is transformers running the
    weights the integers stand for, computed before packing, so a misread of the packing or of v1's zero offset
    shows.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np


def save_compressed_tensors_w4a16(model, folder: Path, group_size: int | None = 32, symmetric: bool = True) -> None:
    """A compressed-tensors pack-quantized W4A16 checkpoint of (a copy of) `model`: 4-bit integer weights with a
    scale per `group_size` input features (None: per output channel), zero points unless `symmetric`, lm_head
    ignored (llm-compressor's W4A16 / W4A16_ASYM presets, with a group size that suits a tiny model)."""
    import torch
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = copy.deepcopy(model)
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, dynamic=False,
                               strategy="channel" if group_size is None else "group", group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                out_features, in_features = module.weight.shape
                size = in_features if group_size is None else group_size
                groups = module.weight.reshape(out_features, in_features // size, size)
                scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def _quantize_groups(weight: np.ndarray, g_idx: np.ndarray, symmetric: bool, clamp_to_zero: bool):
    """(q u8[N, K], zero u8[N, G], scale f16[N, G]) with weight[:, k] ≈ (q[:, k] - zero[:, g]) * scale[:, g] for
    g = g_idx[k], rounded as AutoAWQ's and GPTQ's round-to-nearest quantizers do (their calibration aside); GPTQ
    widens each group's range to hold 0."""
    groups = g_idx.max() + 1
    low = np.stack([weight[:, g_idx == g].min(1) for g in range(groups)], 1)  # f32[N, G]
    high = np.stack([weight[:, g_idx == g].max(1) for g in range(groups)], 1)
    if clamp_to_zero:
        low, high = np.minimum(low, 0), np.maximum(high, 0)
    if symmetric:
        scale = (2 * np.maximum(-low, high) / 15).astype(np.float16)
        zero = np.full(scale.shape, 8.0)
    else:
        scale = (np.maximum(high - low, 1e-5) / 15).astype(np.float16)
        zero = np.clip(np.round(-low / scale.astype(np.float32)), 0, 15)
    q = np.clip(np.round(weight / scale.astype(np.float32)[:, g_idx]) + zero[:, g_idx], 0, 15)
    return q.astype(np.uint8), zero.astype(np.uint8), scale


def _in_order(in_features: int, group_size: int | None) -> np.ndarray:
    return np.arange(in_features) // (in_features if group_size is None else group_size)


def _pack(values: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """int32 words of unsigned 4-bit `values` along `axis`, nibble i of word c holding value 8c + order[i]."""
    moved = np.moveaxis(values.astype(np.uint32), axis, -1)
    words = moved.reshape(*moved.shape[:-1], -1, 8)[..., list(order)]
    packed = (words << (np.arange(8, dtype=np.uint32) * 4)).sum(-1, dtype=np.uint32)
    return np.ascontiguousarray(np.moveaxis(packed, -1, axis)).view(np.int32)


def _projections(tensors: dict) -> list[str]:
    return [name.removesuffix(".weight") for name in tensors
            if ".layers." in name and name.endswith("proj.weight")]


def save_awq(model, folder: Path, group_size: int = 32, scale_dtype=np.float16) -> dict:
    """An AutoAWQ GEMM checkpoint of `model`, packed as AutoAWQ's `WQLinear_GEMM.from_linear` packs it (its package
    pins an old transformers): qweight [K, N/8] and qzeros [G, N/8] interleaved along N, scales [G, N] in
    `scale_dtype` (AutoAWQ's float16; compressed-tensors then dequantizes in float16, so exact comparisons keep them
    float32). Returns the config's quantization_config."""
    import torch

    from tests.fp8_checkpoints import edit_tensors

    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def quantize(tensors):
        for module in _projections(tensors):
            weight = tensors.pop(module + ".weight").float().numpy()
            q, zero, scale = _quantize_groups(weight, _in_order(weight.shape[1], group_size), symmetric=False,
                                              clamp_to_zero=False)
            tensors[module + ".qweight"] = torch.from_numpy(_pack(q.T, 1, order))
            tensors[module + ".qzeros"] = torch.from_numpy(_pack(zero.T, 1, order))
            tensors[module + ".scales"] = torch.from_numpy(np.ascontiguousarray(scale.T.astype(scale_dtype)))

    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    model.save_pretrained(folder)
    edit_tensors(folder, quantize)
    edit_config_file(folder, quantization_config=config)
    return config


def awq_as_compressed_tensors(folder: Path, out: Path) -> Path:
    """`folder`'s AWQ checkpoint converted by compressed-tensors' own AutoAWQConverter into a pack-quantized one in
    `out` (which transformers dequantizes): the AWQ oracle."""
    from safetensors.torch import load_file, save_file

    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    config = json.loads((folder / "config.json").read_text())
    converter = AutoAWQConverter.from_autoawq_config(config["quantization_config"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(converter.process(load_file(folder / "model.safetensors")), out / "model.safetensors",
              metadata={"format": "pt"})
    quantization = converter.update_config(None).model_dump(exclude_none=True)
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": {
        **quantization, "quant_method": "compressed-tensors"}}, indent=2))
    return out


def save_gptq(model, folder: Path, group_size: int | None = 32, symmetric: bool = False, v1: bool = True,
              positive_groups: bool = True, act_order: bool = False):
    """A GPTQ checkpoint of `model` in GPTQModel's layout: qweight [K/8, N] packed along K, qzeros [G, N/8] along N
    (v1: each packed word less 0x11111111, v2: as is), scales f16 [G, N], g_idx [K]. With `positive_groups` the first
    group of every eighth output channel holds only positive weights, so its zero point is 0, which v1 stores as -1
    with a borrow from the next nibble. With `act_order` (desc_act) each group is a random set of group_size input
    features, as quantizing in activation order leaves them, g_idx saying which. Returns the HF model with the
    weights the checkpoint stands for (the oracle)."""
    import copy

    import torch

    from tests.fp8_checkpoints import edit_tensors

    dequantized = copy.deepcopy(model)
    model.save_pretrained(folder)
    weights = {}
    rng = np.random.default_rng(0)

    def quantize(tensors):
        for module in _projections(tensors):
            weight = tensors.pop(module + ".weight").float().numpy().copy()
            g_idx = _in_order(weight.shape[1], group_size)
            if act_order:
                g_idx = g_idx[rng.permutation(weight.shape[1])]
            if positive_groups:
                weight[::8, g_idx == 0] = np.abs(weight[::8, g_idx == 0])
            q, zero, scale = _quantize_groups(weight, g_idx, symmetric, clamp_to_zero=True)
            weights[module] = (q.astype(np.float32) - zero[:, g_idx]) * scale.astype(np.float32)[:, g_idx]
            words = _pack(zero.T, 1).view(np.uint32)
            tensors[module + ".qweight"] = torch.from_numpy(_pack(q.T, 0))
            tensors[module + ".qzeros"] = torch.from_numpy(
                (words - np.uint32(0x11111111) if v1 else words).view(np.int32))
            tensors[module + ".scales"] = torch.from_numpy(np.ascontiguousarray(scale.T))
            tensors[module + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))

    edit_tensors(folder, quantize)
    edit_config_file(folder, quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": -1 if group_size is None else group_size,
        "desc_act": act_order, "sym": symmetric, "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": False})
    with torch.no_grad():
        for name, module in dequantized.named_modules():
            if name in weights:
                module.weight.copy_(torch.from_numpy(weights[name]))
    return dequantized.eval()


def edit_config_file(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}, indent=2))


def save_compressed_tensors_act_order(model, folder: Path, group_size: int = 32):
    """A pack-quantized W4A16_ASYM checkpoint with `actorder: group`, as llm-compressor's GPTQ wrote them before
    compressed-tensors dropped the option: each group a random set of group_size input features, `weight_g_idx`
    naming each feature's group, the weights packed in their original order. Written by compressed-tensors, then its
    tensors and config replaced here (its current version refuses actorder group). Returns the HF model with the
    weights the checkpoint stands for (the oracle)."""
    import torch

    from tests.fp8_checkpoints import edit_tensors

    dequantized = copy.deepcopy(model)
    save_compressed_tensors_w4a16(model, folder, group_size=group_size, symmetric=False)
    originals = dict(model.named_parameters())
    weights = {}
    rng = np.random.default_rng(0)

    def quantize(tensors):
        for module in {name.removesuffix(".weight_packed") for name in tensors if name.endswith(".weight_packed")}:
            weight = originals[module + ".weight"].detach().float().numpy()
            g_idx = _in_order(weight.shape[1], group_size)[rng.permutation(weight.shape[1])]
            q, zero, scale = _quantize_groups(weight, g_idx, symmetric=False, clamp_to_zero=False)
            weights[module] = (q.astype(np.float32) - zero[:, g_idx]) * scale.astype(np.float32)[:, g_idx]
            tensors[module + ".weight_packed"] = torch.from_numpy(_pack(q, 1))  # CT keeps value + 8: q itself
            tensors[module + ".weight_zero_point"] = torch.from_numpy(_pack(zero, 0))
            tensors[module + ".weight_scale"] = torch.from_numpy(scale.astype(np.float32))
            tensors[module + ".weight_g_idx"] = torch.from_numpy(g_idx.astype(np.int32))

    edit_tensors(folder, quantize)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    with torch.no_grad():
        for name, module in dequantized.named_modules():
            if name in weights:
                module.weight.copy_(torch.from_numpy(weights[name]))
    return dequantized.eval()
