"""GPU programs without a GPU: the engine's step programs built for a described GPU (configs/gpu-targets/) on any
machine, with abstract weights, and audited from XLA:GPU's own output.

target.py makes compile-only devices from a target description; build.py lays the model out over them and compiles
every program a start-up compiles; audit.py reads a compiled program's HLO into findings (copies of weights or of
the KV pool, GEMM backends, loops, launches, a static roofline); report.py writes them as JSON and a table;
command.py is `jaxserve compile`. Needs the gpu-audit extra (JAX's CUDA plugin), never a GPU.
"""
