"""The decoder as Flax NNX modules whose parameter paths are HF's tensor names, with the decoder layers stacked.

One parameterised Llama-style decoder serves every supported family (model/families.py): the config says which
projections carry biases, whether q and k heads are RMS-normed before RoPE (Qwen3's `q_norm`/`k_norm`, f[head_dim]
per layer), and which layers attend over a sliding window only.

`LlamaForCausalLM` holds `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight` and one stacked decoder
layer, `model.layers`, whose every parameter carries a leading layer axis: `model.layers.self_attn.q_proj.weight` is
f[num_layers, out, in], layer i of it being HF's `model.layers.i.self_attn.q_proj.weight` in HF's `[out, in]` layout
(the loaders stack HF's per-layer tensors as they read them; `jaxserve/checkpoint/param_tree.py` maps the names).

The stack runs as one `jax.lax.scan` over the layer axis, so a step program holds one layer's code whatever the
depth: its size and compile time do not grow with the number of layers. The KV cache receives the layer index
(a traced scalar) with every call, and indexes its whole pool with it rather than being handed a copied slice.
Callers split the module once (`nnx.split`) and jit pure functions over its state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.config import LlamaConfig
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.lora import LayerLora, LoraStack
from jaxserve.model.quantization import XLA_GEMM, WeightFormat, is_stacked_quantized_weight, reads_in_place
from jaxserve.model.quantized_linear import QUANTIZED_LINEARS, quantized_linear
from jaxserve.model.rope import apply_rotary, inverse_frequencies, rotary_cos_sin

# The window of a full-attention layer in a model whose other layers slide: wider than any context, masking nothing.
FULL_ATTENTION_WINDOW = 1 << 30


class Linear(nnx.Module):
    """y = x @ weight.T (+ bias), with weight f[out, in] as HF stores it."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, rngs: nnx.Rngs, init_std: float,
                 stack: tuple[int, ...] = ()):
        # `stack`: leading axes of stacked copies (the layer axis); the forward pass sees one copy.
        self.weight = nnx.Param(init_std * jax.random.normal(rngs.params(), (*stack, out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((*stack, out_features), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,oi->...o", x, self.weight[...])
        return y if self.bias is None else y + self.bias[...]


def _adapted(projection: nnx.Module, name: str, x: jax.Array, lora: LayerLora | None, layer: jax.Array,
             stacked_gemm: str = XLA_GEMM) -> jax.Array:
    """The projection's output plus, with adapters, each token's own adapter delta. Under `stacked_gemm` other than
    xla, a quantized projection holds every layer's weight and reads layer `layer`'s."""
    if stacked_gemm != XLA_GEMM and isinstance(projection, QUANTIZED_LINEARS):
        y = projection.from_stack(x, layer, stacked_gemm)
    else:
        y = projection(x)
    return y if lora is None else y + lora.delta(name, x)


def _projection(quantization: str | WeightFormat | None, in_features: int, out_features: int, **kwargs) -> nnx.Module:
    """A decoder projection: Linear, or a quantized one (model/quantized_linear.py) when the weights are quantized."""
    if quantization is None:
        return Linear(in_features, out_features, **kwargs)
    return quantized_linear(in_features, out_features, quantization=quantization, **kwargs)


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, cast back before the weight multiplies (as HF does)."""

    def __init__(self, size: int, eps: float, dtype, stack: tuple[int, ...] = ()):
        self.weight = nnx.Param(jnp.ones((*stack, size), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


class Embedding(nnx.Module):
    """Token embedding table f[vocab, hidden]; also the output projection when embeddings are tied."""

    def __init__(self, vocab: int, hidden: int, *, dtype, rngs: nnx.Rngs, init_std: float):
        self.weight = nnx.Param(init_std * jax.random.normal(rngs.params(), (vocab, hidden), dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:  # f[..., hidden] from i32[..., tokens]
        if tokens.size == 1:
            # XLA's partitioner looks up a single id in a vocabulary-split table by gathering the whole table onto
            # every device (2 GB at 70B, every batch-1 step); two ids get a local lookup and one all-reduce.
            return jnp.take(self.weight[...], jnp.concatenate([tokens, tokens], axis=-1), axis=0)[..., :1, :]
        return jnp.take(self.weight[...], tokens, axis=0)


class Attention(nnx.Module):
    """Grouped-query self-attention; the KV cache decides where K/V live and how they are read."""

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, init_std: float, stack: tuple[int, ...],
                 quantization: str | WeightFormat | None):
        hidden, hd = cfg.hidden_size, cfg.head_dim
        linear = dict(dtype=dtype, rngs=rngs, init_std=init_std, stack=stack)
        self.q_proj = _projection(quantization, hidden, cfg.num_attention_heads * hd, bias=cfg.qkv_bias, **linear)
        self.k_proj = _projection(quantization, hidden, cfg.num_key_value_heads * hd, bias=cfg.qkv_bias, **linear)
        self.v_proj = _projection(quantization, hidden, cfg.num_key_value_heads * hd, bias=cfg.qkv_bias, **linear)
        self.o_proj = _projection(quantization, cfg.num_attention_heads * hd, hidden, bias=cfg.o_proj_bias, **linear)
        # One norm per layer over head_dim, shared by all heads (so replicated under tensor parallelism).
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, stack) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, stack) if cfg.qk_norm else None
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = hd

    def __call__(self, x, cos, sin, positions, cache: KVCache, layer: jax.Array, lora: LayerLora | None = None,
                 window: jax.Array | None = None, stacked_gemm: str = XLA_GEMM):
        batch, tokens, _ = x.shape
        gemm = dict(layer=layer, stacked_gemm=stacked_gemm)
        q = _adapted(self.q_proj, "q_proj", x, lora, **gemm).reshape(batch, tokens, self.heads, self.head_dim)
        k = _adapted(self.k_proj, "k_proj", x, lora, **gemm).reshape(batch, tokens, self.kv_heads, self.head_dim)
        v = _adapted(self.v_proj, "v_proj", x, lora, **gemm).reshape(batch, tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Only a windowed model passes its window, so caches without window support still serve every other model
        # and refuse a windowed one (a TypeError) rather than silently attending over the full context.
        windowed = {} if window is None else {"window": window}
        out, cache = cache.update_and_attend(layer, q, k, v, positions, scale=self.head_dim**-0.5, **windowed)
        return _adapted(self.o_proj, "o_proj", out.reshape(batch, tokens, self.heads * self.head_dim), lora,
                        **gemm), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, init_std: float, stack: tuple[int, ...],
                 quantization: str | WeightFormat | None):
        linear = dict(bias=cfg.mlp_bias, dtype=dtype, rngs=rngs, init_std=init_std, stack=stack)
        self.gate_proj = _projection(quantization, cfg.hidden_size, cfg.intermediate_size, **linear)
        self.up_proj = _projection(quantization, cfg.hidden_size, cfg.intermediate_size, **linear)
        self.down_proj = _projection(quantization, cfg.intermediate_size, cfg.hidden_size, **linear)

    def __call__(self, x: jax.Array, lora: LayerLora | None = None, layer: jax.Array | None = None,
                 stacked_gemm: str = XLA_GEMM) -> jax.Array:
        gemm = dict(layer=layer, stacked_gemm=stacked_gemm)
        gate = jax.nn.silu(_adapted(self.gate_proj, "gate_proj", x, lora, **gemm))
        hidden = gate * _adapted(self.up_proj, "up_proj", x, lora, **gemm)
        return _adapted(self.down_proj, "down_proj", hidden, lora, **gemm)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP. Built with `stack=(num_layers,)` it holds every layer's
    parameters on a leading axis; `__call__` runs on one layer's slice of them (inside the model's scan)."""

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, init_std: float, stack: tuple[int, ...] = (),
                 quantization: str | WeightFormat | None = None):
        projections = dict(dtype=dtype, rngs=rngs, init_std=init_std, stack=stack, quantization=quantization)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, stack)
        self.self_attn = Attention(cfg, **projections)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, stack)
        self.mlp = MLP(cfg, **projections)

    def __call__(self, x, cos, sin, positions, cache: KVCache, layer: jax.Array, lora: LayerLora | None = None,
                 window: jax.Array | None = None, stacked_gemm: str = XLA_GEMM):
        attn_out, cache = self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, layer, lora, window,
                                         stacked_gemm)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x), lora, layer, stacked_gemm), cache


class LlamaModel(nnx.Module):
    """Embeddings, the decoder stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, init_std: float,
                 quantization: str | WeightFormat | None):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs, init_std=init_std)
        self.layers = DecoderLayer(cfg, dtype=dtype, rngs=rngs, init_std=init_std, stack=(cfg.num_hidden_layers,),
                                   quantization=quantization)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rope = cfg.rope
        self.head_dim = cfg.head_dim
        self.num_layers = cfg.num_hidden_layers
        self.layer_windows = cfg.layer_windows  # static: each layer's sliding window, None for full attention

    def __call__(self, tokens, positions, cache: KVCache, lora: LoraStack | None = None,
                 token_slots: jax.Array | None = None, stacked_gemm: str = XLA_GEMM):
        """`stacked_gemm` (static; model/quantization.py): with "pallas" (or "pallas_interpret"), a step of at most
        IN_PLACE_MAX_ROWS tokens keeps the quantized weights out of the scan, whole, and its projections read each
        layer's rows of them in place."""
        # A trace-time numpy constant, so it never becomes a parameter.
        cos, sin = rotary_cos_sin(positions, inverse_frequencies(self.rope, self.head_dim))
        x = self.embed_tokens(tokens)
        if not reads_in_place(stacked_gemm, tokens.size, self._projection_format()):
            stacked_gemm = XLA_GEMM
        # `stacked` is scanned (one layer's slice each iteration); `whole`, the quantized weights when the kernel
        # reads them in place, is not.
        if stacked_gemm == XLA_GEMM:
            (layer_def, stacked), whole = nnx.split(self.layers), None
        else:
            layer_def, whole, stacked = nnx.split(self.layers, is_stacked_quantized_weight, ...)

        def run_layer(carry, layer_inputs):
            x, cache = carry
            # One layer's slice of every parameter, its index i32[], its slice of the adapter slots (or None), its
            # window i32[] (or None).
            params, index, slots, window = layer_inputs
            layer_lora = None if slots is None else LayerLora(slots.a, slots.b, token_slots)
            layer = nnx.merge(layer_def, params) if whole is None else nnx.merge(layer_def, whole, params)
            with jax.named_scope("decoder_layer"):
                return layer(x, cos, sin, positions, cache, index, layer_lora, window, stacked_gemm), None

        layer_indices = jnp.arange(self.num_layers, dtype=jnp.int32)  # i32[num_layers]
        (x, cache), _ = jax.lax.scan(run_layer, (x, cache), (stacked, layer_indices, lora, self._windows()))
        return self.norm(x), cache

    def _projection_format(self) -> WeightFormat | None:
        projection = self.layers.self_attn.q_proj
        return projection.format if isinstance(projection, QUANTIZED_LINEARS) else None

    def _windows(self) -> jax.Array | None:
        """i32[num_layers]: each layer's sliding window, FULL_ATTENTION_WINDOW where the layer has none; None when no
        layer has one (the scan then carries no window and the step programs are those of plain full attention)."""
        if all(window is None for window in self.layer_windows):
            return None
        return jnp.array([FULL_ATTENTION_WINDOW if window is None else window for window in self.layer_windows],
                         jnp.int32)


class LlamaForCausalLM(nnx.Module):
    """The full causal LM. `__call__` returns final hidden states; `logits` projects only the rows asked for.

    With `quantization` ("int8", "fp8" or a `WeightFormat`), the decoder's projections hold quantized weights and
    their scales; the parameters are then filled by the loader (model/quantization.py), not drawn."""

    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, init_std: float = 0.02,
                 quantization: str | WeightFormat | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.config = cfg
        self.model = LlamaModel(cfg, dtype=dtype, rngs=rngs, init_std=init_std, quantization=quantization)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs, init_std=init_std
        )

    def __call__(
        self,
        tokens: jax.Array,  # i32[batch, tokens]
        positions: jax.Array,  # i32[batch, tokens]
        cache: KVCache,
        lora: LoraStack | None = None,  # adapter slots; None: the base model alone
        token_slots: jax.Array | None = None,  # i32[batch * tokens]: each token's adapter slot, with `lora`
        stacked_gemm: str = XLA_GEMM,  # static: how quantized projections read their weights (LlamaModel)
    ) -> tuple[jax.Array, KVCache]:  # f[batch, tokens, hidden], updated cache
        return self.model(tokens, positions, cache, lora, token_slots, stacked_gemm)

    def logits(self, hidden: jax.Array) -> jax.Array:  # f32[..., vocab] from f[..., hidden]
        weight = self.model.embed_tokens.weight[...] if self.lm_head is None else self.lm_head.weight[...]
        return jnp.einsum("...h,vh->...v", hidden, weight, preferred_element_type=jnp.float32)


def projection_format(model: LlamaForCausalLM) -> WeightFormat | None:
    """The quantized format of the decoder's projections (all alike), or None where they are not quantized."""
    projection = model.model.layers.self_attn.q_proj
    return projection.format if isinstance(projection, QUANTIZED_LINEARS) else None
