"""Stream HF safetensors weights onto the devices one tensor at a time, each device receiving only its shard.

Every header is read and checked against the config first, so a wrong config fails in a second rather than after
minutes of loading. Then each parameter is read from its (memory-mapped) files one device shard at a time (only that
shard's bytes; a stacked decoder parameter's shard gathers that slice of every layer's tensor), cast on the host,
copied to its device and waited for before the next parameter: host RAM holds at most one parameter's shards (and
their cast copies) at any moment.

Casting on the host rather than on the device keeps the device's peak at exactly the target-dtype weights: a device
cast would briefly hold the stored and the cast copy of a tensor side by side there, where memory is scarcest (and
left over is what the KV cache gets). Downcasting on the host also halves the bytes sent to the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from jaxserve.checkpoint.model_files import safetensors_files
from jaxserve.checkpoint.param_tree import FoundTensor, TensorTarget, check_tensors_match
from jaxserve.checkpoint.shard_placement import place_tensor
from jaxserve.errors import ModelLoadError, UnsupportedModelError

# Buffers some older checkpoints carry; the model computes them from the config instead.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)

TIED_EMBEDDING = "model.embed_tokens.weight"
OUTPUT_PROJECTION = "lm_head.weight"

_STORED_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it."""

    file: Path  # the file holding it
    shape: tuple[int, ...]  # as stored, HF's [out, in] for projections
    dtype: np.dtype  # as stored

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def load_safetensors(
    model_dir: Path,
    targets: Mapping[str, TensorTarget],
    progress: bool,
    keep_stored_dtype: bool = False,
) -> dict[str, jax.Array]:
    """Parameter name -> device array, for exactly the names in `targets`, placed and cast as each target says.

    With `keep_stored_dtype` each array keeps the dtype it has on disk instead (conversion stores weights unchanged).
    """
    return plan_safetensors_load(model_dir, targets, keep_stored_dtype)(progress)


def plan_safetensors_load(
    model_dir: Path,
    targets: Mapping[str, TensorTarget],
    keep_stored_dtype: bool = False,
) -> Callable[[bool], dict[str, jax.Array]]:
    """Checks every header against `targets` now (in a second, before anything waits on the weights) and returns
    the read itself, which takes `progress` and streams the tensors as `load_safetensors` does."""
    stored = read_checkpoint_headers(model_dir, targets)
    if keep_stored_dtype:
        targets = {name: dataclasses.replace(target, placed=target.placed.update(dtype=stored[target.sources[0]].dtype))
                   for name, target in targets.items()}
    return functools.partial(stream_to_device, stored, targets)


def read_checkpoint_headers(model_dir: Path, targets: Mapping[str, TensorTarget]) -> dict[str, StoredTensor]:
    """The stored tensors the model needs, after checking their names and shapes against `specs`.

    Only headers are read. Raises `UnsupportedModelError` for non-float (quantized) tensors.
    """
    stored = _drop_ignored(_read_all_headers(safetensors_files(model_dir)), targets)
    found = {name: FoundTensor(shape=tensor.shape, location=tensor.file.name) for name, tensor in stored.items()}
    check_tensors_match(found, targets, where=str(model_dir))
    return stored


def stream_to_device(
    stored: Mapping[str, StoredTensor],
    targets: Mapping[str, TensorTarget],
    progress: bool,
) -> dict[str, jax.Array]:
    """Read, cast and transfer one parameter at a time (shard by shard), every file open (memory-mapped) at once."""
    arrays = {}
    total_bytes = sum(tensor.nbytes for tensor in stored.values())
    with (contextlib.ExitStack() as files,
          tqdm(total=total_bytes, unit="B", unit_scale=True, desc="Loading safetensors", disable=not progress) as bar):
        readers = {file: files.enter_context(open_safetensors(file)) for file in _files(stored)}
        for name, target in targets.items():
            sources = [tensor_slice(readers[stored[source].file], source, stored[source].file)
                       for source in target.sources]
            where = ", ".join(sorted({stored[source].file.name for source in target.sources}))
            arrays[name] = to_device(sources, target, f"{name} from {where}")
            bar.update(sum(stored[source].nbytes for source in target.sources))
    return arrays


def tensor_slice(reader: safe_open, name: str, file: Path):
    """A lazy view of one tensor: indexing it reads only the indexed part, in its stored dtype."""
    try:
        return reader.get_slice(name)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read tensor {name} from {file} (corrupt file?): {e}") from None


def to_device(sources: list, target: TensorTarget, what: str) -> jax.Array:
    """Read, cast and copy each device's shard, and wait, so host buffers are released before the next tensor.

    `what` names the parameter and its files in the error raised when the data cannot be read.
    """
    try:
        return place_tensor(sources, target).block_until_ready()
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read tensor {what} (corrupt file?): {e}") from None


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[safe_open]:
    """`safe_open` with numpy output, turning a corrupt or truncated file into a `ModelLoadError` naming it."""
    try:
        reader = safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{file} is not a valid safetensors file (corrupt or truncated?): {e}") from None
    with reader:
        yield reader


def _read_all_headers(files: list[Path]) -> dict[str, StoredTensor]:
    stored: dict[str, StoredTensor] = {}
    for file in files:
        with open_safetensors(file) as reader:
            for name in reader.keys():
                if name in stored:
                    raise ModelLoadError(f"tensor {name} appears in both {stored[name].file.name} and {file.name}")
                stored[name] = _describe(reader, name, file)
    return stored


def _describe(reader: safe_open, name: str, file: Path) -> StoredTensor:
    header = reader.get_slice(name)
    code = header.get_dtype()
    if code not in _STORED_DTYPES:
        raise UnsupportedModelError(
            f"tensor {name} in {file} has dtype {code}; jaxserve loads float weights only "
            f"({', '.join(_STORED_DTYPES)}), not quantized checkpoints"
        )
    return StoredTensor(file=file, shape=tuple(header.get_shape()), dtype=_STORED_DTYPES[code])


def _drop_ignored(
    stored: dict[str, StoredTensor],
    targets: Mapping[str, TensorTarget],
) -> dict[str, StoredTensor]:
    """Leave out rotary buffers, and a redundant lm_head copy some exports of tied-embedding models carry."""
    return {
        name: tensor
        for name, tensor in stored.items()
        if not name.endswith(IGNORED_TENSOR_SUFFIXES) and not _is_redundant_output_projection(name, tensor, targets)
    }


def _is_redundant_output_projection(name: str, tensor: StoredTensor, targets: Mapping[str, TensorTarget]) -> bool:
    return (
        name == OUTPUT_PROJECTION
        and OUTPUT_PROJECTION not in targets
        and TIED_EMBEDDING in targets
        and tensor.shape == targets[TIED_EMBEDDING].stored_shape
    )


def _files(stored: Mapping[str, StoredTensor]) -> list[Path]:
    return list(dict.fromkeys(tensor.file for tensor in stored.values()))
