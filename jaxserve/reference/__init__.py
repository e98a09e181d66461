"""The simple oracles the tests check the product against: a dense-cache decoder with whole-batch prefill
(`ReferenceLLM`, `DenseDecoder`, `DenseKVCache`) and a numpy sampler (`host_sampler`). They trade speed for
plainness; the product never imports this package (tests/test_layering.py checks it)."""
