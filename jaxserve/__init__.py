"""jaxserve: LLM inference on JAX/XLA.

Offline use mirrors vLLM::

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-llama")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from jaxserve.entrypoints.llm import LLM
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
