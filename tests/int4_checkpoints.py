"""Tiny 4-bit (W4A16) Llama checkpoints in the exact layout vLLM users download, written by the format's own
library: compressed-tensors `pack-quantized`, as llm-compressor drives it (its quantization config applied to a
tiny HF Llama, `calculate_qparams` turning each group's min and max into scales and zero points, its compressor
packing the weights and writing config.json). transformers reads them back dequantized
(tests/fp8_checkpoints.py `transformers_dequantized`): the oracle. Needs the parity extra; callers skip without it.
"""

from __future__ import annotations

import copy
from pathlib import Path


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
