"""Tiny random-weight models of the fast path's other families (Qwen3, Gemma 2, Gemma 3 text), and the rank
process of their tensor-parallel test. transformers is imported inside the functions: a rank process needs none."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 16  # the sliding window of the Gemma models (the tests run past it)


def make_tiny_family(path: Path, family: str, seed: int = 0, safetensors: bool = True, hidden: int = 32,
                     overrides: dict | None = None) -> Path:
    """A 3-layer random model of `family` (GQA 4/2 heads of 16, vocab 96, no EOS): Gemma's layers slide, go
    global, slide; Gemma 3's global layer has linear RoPE scaling and the sliding ones their own base.
    `overrides`: config keys set over these (e.g. `{"attn_logit_softcapping": None}`: Gemma 2 without the cap)."""
    import transformers

    common = dict(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=None, pad_token_id=0)
    gemma = dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if family == "qwen3":
        config = transformers.Qwen3Config(**common, rms_norm_eps=1e-5, tie_word_embeddings=True)
    elif family == "gemma2":  # small caps, so that capping changes the logits
        config = transformers.Gemma2Config(**common, **gemma, final_logit_softcapping=2.0, attn_logit_softcapping=5.0,
                                           tie_word_embeddings=False)
    else:
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}
        config = transformers.Gemma3TextConfig(**common, **gemma, rope_parameters=rope)
    if overrides:
        config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # weights large enough that a wrong norm, mask or RoPE shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by (1 + weight)
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1 if p.dim() == 1 else hidden**-0.5)
    model.save_pretrained(path)
    if not safetensors:  # the older PyTorch format (transformers 5 saves safetensors only)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
        for file in path.glob("*.safetensors"):
            file.unlink()
    return path


def tp_rank(rank: int, world_size: int, init: str, paths: dict[str, str], out_dir: str) -> None:
    """One rank: each family's fixed calls (`tests.support.tp.script`: prefills, a ragged verify call, greedy
    decoding to position ~26, past the window) on this rank's shard; rank 0 saves what it got."""
    import torch.distributed as dist

    from pipeline.models.graphs import GraphConfig
    from pipeline.models.tensor_parallel import init_tensor_parallel, load_tensor_parallel_model, tensor_parallel_graphs
    from tests.support.tp import MAX_LEN, SLOTS, script

    tp = init_tensor_parallel(rank, world_size, init, "cpu", collective_timeout_s=60, control_timeout_s=30)
    results = {}
    for family, path in paths.items():
        runner = load_tensor_parallel_model(path, tp)
        runner.allocate(SLOTS, MAX_LEN)
        results[family] = script(runner, runner.info.vocab_size)
        results[family]["num_parameters"] = runner.info.num_parameters
        static = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4))
        graphs = tensor_parallel_graphs(runner, static)
        results[family]["graphs_refused"] = graphs is runner  # the eager sharded runner, on every rank alike
        if graphs is not runner:  # the static-shape path, uncaptured on CPU
            graphs.allocate(SLOTS, MAX_LEN)
            results[family]["graphs"] = script(graphs, runner.info.vocab_size)
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
    dist.destroy_process_group()
