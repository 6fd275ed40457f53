"""The demo pair served end to end (SmolLM2-135M-Instruct target; prompt lookup in the coordinator and the shipped
distilled drafter on a drafter replica, the default of `specserve serve`): greedy output through HTTP equals the
core engine's and Hugging Face's, for completions and chat, streamed (openai client, curl -N) and not, with stop
strings. The app is the one of the HTTP edge's tests (tests/support/edge_app.py), so requests carry its API key."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.edge_app import AUTH, KEY, edge_app
from tests.support.serve import sse_events

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "List three uses of a paperclip."}]
N = 32


@pytest.fixture(scope="module")
def server(demo_path):
    return edge_app(demo_path)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine(demo_path):
    from pipeline.config import EngineConfig
    from pipeline.drafters import HYBRID_PREFIX
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.store import DEMO_DRAFT

    return SpeculativeEngine.from_pretrained(demo_path, HYBRID_PREFIX + DEMO_DRAFT,
                                             EngineConfig(max_batch_size=1, max_seq_len=1024))


@pytest.fixture(scope="module")
def hf(demo_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(demo_path, dtype="float32").eval()
    return model


def hf_greedy(hf, ids, n):
    import torch

    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_completion_equals_engine_and_hf(client, engine, hf):
    from pipeline.config import SamplingParams, SpecParams

    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0)
    got = full.choices[0].token_ids
    ids = engine.encode(PROMPT)
    want = engine.generate(PROMPT, SamplingParams(max_tokens=N), SpecParams(4)).token_ids
    assert got == want
    assert got == hf_greedy(hf, ids, N)[: len(got)]
    assert full.choices[0].text == engine.tokenizer.decode(got, skip_special_tokens=True)
    assert full.usage.prompt_tokens == len(ids)
    assert full.speculation["drafter"].startswith("lookup+")

    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == full.choices[0].text


def test_greedy_chat_equals_engine_and_hf(client, engine, hf):
    from pipeline.config import SamplingParams, SpecParams

    model = client.models.list().data[0].id
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0)
    got = full.choices[0].token_ids
    want = engine.generate(MESSAGES[0]["content"], SamplingParams(max_tokens=N), SpecParams(4), chat=True)
    assert got == want.token_ids
    ids = engine.encode(MESSAGES[0]["content"], chat=True)
    assert got == hf_greedy(hf, ids, N)[: len(got)]
    assert full.choices[0].message.content == want.text

    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_stop_strings_match_the_engine(client, engine):
    from pipeline.config import SamplingParams, SpecParams

    model = client.models.list().data[0].id
    want = engine.generate(PROMPT, SamplingParams(max_tokens=N, stop=(",",)), SpecParams(4))
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, stop=[","])
    assert got.choices[0].text == want.text and "," not in got.choices[0].text
    assert got.choices[0].finish_reason == "stop"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_streams_sse_until_done(server, client):
    model = client.models.list().data[0].id
    body = f'{{"model": "{model}", "prompt": "{PROMPT}", "max_tokens": 12, "temperature": 0, "stream": true}}'
    out = subprocess.run(["curl", "-sN", f"{server}/v1/completions", "-H", "Content-Type: application/json",
                          "-H", f"Authorization: {AUTH['Authorization']}", "-d", body],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    events = list(sse_events(iter(out.splitlines())))
    assert events[-1][1] == "[DONE]"
    text = "".join(d["choices"][0]["text"] for _, d in events[:-1] if d["choices"])
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert text == full.choices[0].text
