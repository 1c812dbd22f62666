"""tessera.llm: serve LLMs with a paged KV cache and continuous batching.

    from tessera.llm import LLM, SamplingParams
    llm = LLM("path/to/hf-model-dir", device="cpu")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from tessera.llm.engine import EngineStats, LLMEngine, StepFailure
from tessera.llm.llm import LLM
from tessera.llm.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tessera.llm.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams", "StepFailure",
           "TokenLogprob"]
