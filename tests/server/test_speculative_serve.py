"""`astrai serve --speculative ngram`: the same text as without it, and the guesses in /metrics."""

from __future__ import annotations

import httpx
import openai
from serve_process import astrai_serve

from astrai.inference import InferenceEngine
from astrai.launch import DEMO_MODEL_DIR
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

PROMPT = "Return the file. Return the file. Return the file. Return the"


def metrics(base: str) -> dict[str, float]:
    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    return {
        line.split()[0]: float(line.split()[-1])
        for line in lines
        if line.startswith("astrai_speculative")
    }


def test_served_speculation_keeps_the_text_and_counts_its_guesses():
    model = AutoModel.from_pretrained(DEMO_MODEL_DIR, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    with InferenceEngine(model, tokenizer, kv_cache_memory=64 << 20) as engine:
        expected = engine.generate(PROMPT, max_tokens=48, temperature=0.0)
    with astrai_serve(
        DEMO_MODEL_DIR, "--speculative", "ngram", "--kv-cache-memory", "64000000"
    ) as (
        _,
        base,
    ):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        request = dict(model="demo", prompt=PROMPT, max_tokens=48, temperature=0.0)
        plain = client.completions.create(**request).choices[0].text
        streamed = "".join(
            chunk.choices[0].text for chunk in client.completions.create(**request, stream=True)
        )
        counts = metrics(base)
    assert plain == streamed == expected
    assert counts["astrai_speculative_proposed_tokens_total"] > 0
    assert counts["astrai_speculative_acceptance_rate"] == (
        counts["astrai_speculative_accepted_tokens_total"]
        / counts["astrai_speculative_proposed_tokens_total"]
    )
