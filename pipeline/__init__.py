"""specserve's algorithm core: exact speculative decoding in pure torch.

Public API:
    SpeculativeEngine   generate / generate_batch / stream (pipeline.engine)
    SamplingParams      temperature, top_k, top_p, max_tokens, stop, seed
    SpecParams          K (num_draft_tokens), draft_top_k
    EngineConfig        slots, context length, device, dtype, CUDA graphs, draft weights
"""

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.engine import GenerationResult, SpeculativeEngine, StreamEvent

__all__ = ["EngineConfig", "GenerationResult", "SamplingParams", "SpecParams", "SpeculativeEngine", "StreamEvent"]
