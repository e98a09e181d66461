"""Pre-quantized FP8 and 4-bit checkpoints under tensor parallelism on 8 simulated CPU devices, printed as one JSON object on
stdout's last line.

Run by tests/test_quantized_checkpoints.py in a subprocess (the device count must be set before JAX starts, which
importing tests.tensor_parallel_probe does). Usage: python -m tests.quantized_checkpoint_probe WORK_DIR (from the
repository root). The model has 8 query heads and 2 KV heads of 16 rows, so TP 4 repeats each KV head; 16x16
blocks then hold whole blocks on every device, 32-row blocks would be split by the repetition.
"""

import json
import shutil
import sys
from pathlib import Path

from tests.tensor_parallel_probe import engine_report  # first: it gives JAX 8 host devices

from jaxserve.checkpoint import plan_model  # noqa: E402
from jaxserve.errors import ConfigError  # noqa: E402
from tests.fp8_checkpoints import save_compressed_tensors, vary_block_magnitudes  # noqa: E402
from tests.hf_models import build_tiny_hf_llama, edit_config  # noqa: E402
from tests.int4_checkpoints import save_compressed_tensors_w4a16  # noqa: E402

# Vocabulary 512: tests.test_engine's workload draws token ids below 500.
MODEL = dict(vocab_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=128)
# Checkpoint -> (writer, its arguments, tensor-parallel sizes whose engines run); int4: 16-column groups with zero
# points, split with their rows (column-parallel), or with their columns (row-parallel: 64 of o_proj's 128 at TP 2,
# one packed block)
CHECKPOINTS = {"block": (save_compressed_tensors, dict(strategy="block", block=(16, 16), inputs=None), (1, 2, 4)),
               "channel": (save_compressed_tensors, dict(strategy="channel", inputs="static"), (1, 4)),
               "int4": (save_compressed_tensors_w4a16, dict(group_size=16, symmetric=False), (1, 2))}
# Sizes tensor parallelism must refuse: (checkpoint, the weights' setting changed, its value, tensor-parallel size)
REFUSED = {"kv heads repeated": ("block", "block_structure", [32, 16], 4),
           "row-parallel columns": ("block", "block_structure", [16, 48], 2),
           "int4 group split": ("int4", "group_size", 48, 2)}


def refusal(folder: Path, copy: Path, setting: str, value, tp: int) -> str:
    """The ConfigError message of planning `folder` with its weights' `setting` changed to `value` (the check reads
    the config alone), or "" when nothing is refused."""
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["weights"][setting] = value
    edit_config(copy, quantization_config=config)
    try:
        plan_model(copy, "float32", tensor_parallel_size=tp)
    except ConfigError as e:
        return str(e)
    return ""


def main(work_dir: Path) -> None:
    model = vary_block_magnitudes(build_tiny_hf_llama("llama31", **MODEL))
    engines = {}
    for name, (writer, arguments, sizes) in CHECKPOINTS.items():
        writer(model, work_dir / name, **arguments)
        engines[name] = {tp: engine_report(work_dir / name, tp) for tp in sizes}
    refused = {case: refusal(work_dir / name, work_dir / case.replace(" ", "-"), setting, value, tp)
               for case, (name, setting, value, tp) in REFUSED.items()}
    print(json.dumps({"engines": engines, "refused": refused}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
