"""jaxserve: LLM inference on JAX/XLA.

Offline use mirrors vLLM::

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-llama")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, PoolingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput"]


def __getattr__(name: str):
    # LLM pulls in JAX; importing it lazily keeps host-only modules (scheduler, page pool, tokenizers) JAX-free.
    if name == "LLM":
        from jaxserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
