"""The Llama model: config parsing, RoPE, Flax NNX modules and the dense KV cache."""
