"""Distil a small drafter from a target: `specserve distill`.

    data (generate.py)  the target answers offline prompts (sequence-level knowledge distillation)
    vocab (vocab.py)    the draft's output vocabulary: the target's most frequent answer tokens
    drafter.py          a few-layer model of the target's architecture, initialised from the target
    train.py            token-level forward KL to the target's distributions, several variants at once
    evaluate.py         tokens per target pass at K drafts (exact for greedy), per category and position
    run.py              the whole pipeline, resumable, writing a loadable HF folder

Pure torch + transformers: no Ray, Redis, HTTP or tracing here.
"""

from pipeline.distill.config import DistillConfig

__all__ = ["DistillConfig", "distill"]


def distill(cfg: DistillConfig, progress=None):  # lazy: importing the package stays cheap
    from pipeline.distill.run import distill as _distill

    return _distill(cfg, progress)
