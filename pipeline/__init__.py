"""specserve's algorithm core: exact speculative decoding in pure torch.

Public API:
    SpeculativeEngine   generate / generate_batch / stream (pipeline.engine)
    SamplingParams      temperature, top_k, top_p, max_tokens, stop, seed
    SpecParams          K (num_draft_tokens), draft_top_k
    EngineConfig        slots, context length, device, dtype, CUDA graphs, draft weights

The engine's names load on first use, so `import pipeline.config` (the HTTP edge, the CLI's parser) or running a
module such as `python -m pipeline.models.store` does not import the engine and the models.
"""

from typing import Any

from pipeline.config import EngineConfig, SamplingParams, SpecParams

_ENGINE_NAMES = ("GenerationResult", "SpeculativeEngine", "StreamEvent")

__all__ = ["EngineConfig", "GenerationResult", "SamplingParams", "SpecParams", "SpeculativeEngine", "StreamEvent"]


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        from pipeline import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
