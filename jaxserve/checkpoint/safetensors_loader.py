"""Stream HF safetensors weights onto the devices one tensor at a time, each device receiving only its shard.

Every header is read and checked against the config first, so a wrong config fails in a second rather than after
minutes of loading. Then each parameter is read from its (memory-mapped) files one device shard at a time (only that
shard's bytes; a stacked decoder parameter's shard gathers that slice of every layer's tensor), cast on the host,
copied to its device and waited for before the next parameter: host RAM holds at most one parameter's shards (and
their cast copies) at any moment.

Casting on the host rather than on the device keeps the device's peak at exactly the target-dtype weights: a device
cast would briefly hold the stored and the cast copy of a tensor side by side there, where memory is scarcest (and
left over is what the KV cache gets). Downcasting on the host also halves the bytes sent to the device.

Float8 weights (F8_E4M3, pre-quantized FP8 checkpoints) are read memory-mapped at the offset the header gives, since
safetensors' numpy reader has no float8 dtype; they go only into float8 parameters, never cast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from jaxserve.checkpoint.model_files import safetensors_files
from jaxserve.checkpoint.param_tree import FoundTensor, TensorTarget, UnreadTensors, check_tensors_match
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
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
    # Packed 4-bit weights and their zero points (int32 words), and each one's shape (int64, never read); only
    # targets that name their stored dtype (TensorTarget.stored_dtype) take them
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}
_INTEGER_DTYPES = frozenset({np.dtype(np.int32), np.dtype(np.int64)})
# Stored dtypes safetensors' numpy reader cannot return (numpy has no float8): read memory-mapped instead. Only
# quantized parameters (of the same dtype) take them.
_MEMMAPPED_DTYPES = frozenset({np.dtype(jnp.float8_e4m3fn)})
_HEADER_LENGTH_BYTES = 8  # a safetensors file starts with its JSON header's length, a little-endian u64


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it."""

    file: Path  # the file holding it
    shape: tuple[int, ...]  # as stored, HF's [out, in] for projections
    dtype: np.dtype  # as stored
    # Byte offset of its data in the file, for a dtype read memory-mapped (_MEMMAPPED_DTYPES); None: read through
    # safe_open
    data_offset: int | None = None

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
    unread: UnreadTensors = UnreadTensors(),
) -> Callable[[bool], dict[str, jax.Array]]:
    """Checks every header against `targets` and `unread` now (in a second, before anything waits on the weights)
    and returns the read itself, which takes `progress` and streams the tensors as `load_safetensors` does."""
    stored = read_checkpoint_headers(model_dir, targets, unread)
    if keep_stored_dtype:
        targets = {name: dataclasses.replace(target, placed=target.placed.update(dtype=stored[target.sources[0]].dtype))
                   for name, target in targets.items()}
    return functools.partial(stream_to_device, stored, targets)


def read_checkpoint_headers(model_dir: Path, targets: Mapping[str, TensorTarget],
                            unread: UnreadTensors = UnreadTensors()) -> dict[str, StoredTensor]:
    """The stored tensors the model needs, after checking their names and shapes against `targets` and `unread`.

    Only headers are read. Raises `UnsupportedModelError` for integer tensors, and for float8 ones outside the
    float8 parameters of a pre-quantized checkpoint.
    """
    stored = _drop_ignored(_read_all_headers(safetensors_files(model_dir)), targets, unread.dropped_suffixes)
    _check_quantized_dtypes(stored, targets)
    found = {name: FoundTensor(shape=tensor.shape, location=tensor.file.name) for name, tensor in stored.items()}
    check_tensors_match(found, targets, where=str(model_dir), unread=unread)
    return stored


def _check_quantized_dtypes(stored: Mapping[str, StoredTensor], targets: Mapping[str, TensorTarget]) -> None:
    """Float8 tensors go into float8 parameters and nowhere else: a cast either way would drop their scales. Checked
    before names and shapes, so that float8 weights under a config without quantization_config are named as such."""
    for target in targets.values():
        quantized = target.placed.dtype in _MEMMAPPED_DTYPES
        for name in filter(stored.__contains__, target.sources):
            tensor = stored[name]
            if target.stored_dtype is not None or tensor.dtype in _INTEGER_DTYPES:
                _check_integer_dtype(name, tensor, target)
                continue
            if tensor.dtype in _MEMMAPPED_DTYPES and not quantized:
                raise UnsupportedModelError(
                    f"tensor {name} in {tensor.file} is float8 ({tensor.dtype.name}), but config.json has no "
                    f"quantization_config saying how it is scaled")
            if quantized and tensor.dtype != target.placed.dtype:
                raise ModelLoadError(
                    f"tensor {name} in {tensor.file} has dtype {tensor.dtype.name}, but the checkpoint's "
                    f"quantization_config stores it as {target.placed.dtype.name}")


def _check_integer_dtype(name: str, tensor: StoredTensor, target: TensorTarget) -> None:
    """A packed tensor is stored in the dtype its format names; an integer tensor goes nowhere else."""
    if target.stored_dtype is None:
        raise UnsupportedModelError(
            f"tensor {name} in {tensor.file} has dtype {tensor.dtype.name}; jaxserve loads float weights only, "
            f"packed integer ones from 4-bit checkpoints whose config.json says so")
    if tensor.dtype != target.stored_dtype:
        raise ModelLoadError(f"tensor {name} in {tensor.file} has dtype {tensor.dtype.name}, but the checkpoint's "
                             f"quantization_config stores it as {target.stored_dtype.name}")


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
            sources = [_source(readers[stored[source].file], source, stored[source]) for source in target.sources]
            where = ", ".join(sorted({stored[source].file.name for source in target.sources}))
            arrays[name] = to_device(sources, target, f"{name} from {where}")
            bar.update(sum(stored[source].nbytes for source in target.sources))
    return arrays


def _source(reader: safe_open, name: str, tensor: StoredTensor):
    """A lazy view of one tensor (indexing it reads only the indexed part): through safe_open, or memory-mapped."""
    return tensor_slice(reader, name, tensor.file) if tensor.data_offset is None else _memmapped(name, tensor)


def _memmapped(name: str, tensor: StoredTensor) -> np.ndarray:
    """Tensor `name`'s data mapped from its file as an array of its dtype and shape (nothing read until indexed)."""
    try:
        data = np.memmap(tensor.file, np.uint8, "r", offset=tensor.data_offset, shape=(tensor.nbytes,))
    except (OSError, ValueError) as e:  # ValueError: the file ends before the data the header places
        raise ModelLoadError(f"cannot read tensor {name} from {tensor.file} (corrupt file?): {e}") from None
    return data.view(tensor.dtype).reshape(tensor.shape)


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


def read_scalars(model_dir: Path, names: list[str]) -> dict[str, float]:
    """The named one-element tensors of the folder's safetensors, as floats (names it lacks are left out): small
    tensors read at plan time, such as KV-cache scales. ModelLoadError for one holding more than one value."""
    values = {}
    for name, (tensor, file) in _read_small(model_dir, names).items():
        if tensor.size != 1:
            raise ModelLoadError(f"tensor {name} in {file.name} has shape {tuple(tensor.shape)}; a scale of one "
                                 f"value was expected")
        values[name] = float(np.asarray(tensor, np.float32).reshape(()))
    return values


def read_small_tensors(model_dir: Path, names: list[str]) -> dict[str, np.ndarray]:
    """The named tensors of the folder's safetensors, whole, as stored (names it lacks are left out): small tensors
    read at plan time, such as GPTQ's g_idx."""
    return {name: np.asarray(tensor) for name, (tensor, _) in _read_small(model_dir, names).items()}


def _read_small(model_dir: Path, names: list[str]) -> dict[str, tuple[np.ndarray, Path]]:
    found = {}
    for file in safetensors_files(model_dir):
        with open_safetensors(file) as reader:
            for name in set(names) & set(reader.keys()):
                found[name] = (tensor_slice(reader, name, file)[...], file)
    return found


def _read_all_headers(files: list[Path]) -> dict[str, StoredTensor]:
    stored: dict[str, StoredTensor] = {}
    for file in files:
        with open_safetensors(file) as reader:
            described = {name: _describe(reader, name, file) for name in reader.keys()}
        for name, tensor in _with_data_offsets(described, file).items():
            if name in stored:
                raise ModelLoadError(f"tensor {name} appears in both {stored[name].file.name} and {file.name}")
            stored[name] = tensor
    return stored


def _with_data_offsets(described: dict[str, StoredTensor], file: Path) -> dict[str, StoredTensor]:
    """`described` (the tensors of `file`) with each memory-mapped one's data offset, from the raw header (which
    safe_open does not expose): its JSON gives each tensor's byte range counted from the header's end."""
    if not any(tensor.dtype in _MEMMAPPED_DTYPES for tensor in described.values()):
        return described
    with open(file, "rb") as raw:
        length = int.from_bytes(raw.read(_HEADER_LENGTH_BYTES), "little")
        header = json.loads(raw.read(length))
    data_start = _HEADER_LENGTH_BYTES + length
    return {name: dataclasses.replace(tensor, data_offset=data_start + header[name]["data_offsets"][0])
            if tensor.dtype in _MEMMAPPED_DTYPES else tensor for name, tensor in described.items()}


def _describe(reader: safe_open, name: str, file: Path) -> StoredTensor:
    header = reader.get_slice(name)
    code = header.get_dtype()
    if code not in _STORED_DTYPES:
        raise UnsupportedModelError(
            f"tensor {name} in {file} has dtype {code}; jaxserve loads float weights only "
            f"({', '.join(code for code, dtype in _STORED_DTYPES.items() if dtype not in _INTEGER_DTYPES)}), float8 "
            f"ones from FP8 checkpoints, packed int32 ones from 4-bit checkpoints"
        )
    return StoredTensor(file=file, shape=tuple(header.get_shape()), dtype=_STORED_DTYPES[code])


def _drop_ignored(
    stored: dict[str, StoredTensor],
    targets: Mapping[str, TensorTarget],
    dropped_suffixes: tuple[str, ...] = (),
) -> dict[str, StoredTensor]:
    """Leave out rotary buffers, tensors ending in `dropped_suffixes`, and a redundant lm_head copy some exports of
    tied-embedding models carry."""
    ignored = IGNORED_TENSOR_SUFFIXES + dropped_suffixes
    return {
        name: tensor
        for name, tensor in stored.items()
        if not name.endswith(ignored) and not _is_redundant_output_projection(name, tensor, targets)
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
