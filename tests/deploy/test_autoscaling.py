"""Autoscaling on requests in flight: a deployment of one to two demo-model replicas on a local
Ray cluster of its own (so the fixed replicas of test_deploy.py do not share its CPUs)."""

from __future__ import annotations

import asyncio
import time

import openai
import ray
from ray import serve
from test_deploy import API_KEY, MODEL, REPLICA, SERVE_FLAGS, chat, free_port

from astrai.deploy import build_app


def test_a_second_replica_starts_under_load(monkeypatch, tmp_path):
    """Target 2 requests in flight a replica, no delay before scaling up: under 12 streams at a
    time a second replica starts and takes requests."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(tmp_path / "astrai-cache"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        application = build_app(
            num_replicas=1,
            max_replicas=2,
            target_ongoing_requests=2,
            upscale_delay_s=0.0,
            replica_cpus=0.5,
            serve_flags=SERVE_FLAGS,
        )
        serve.run(application, name="astrai", route_prefix="/")
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )

        async def replica_of(i: int) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=chat(f"{i} pages?"), max_tokens=32, stream=True
            )
            _ = [chunk async for chunk in raw.parse()]
            return raw.headers[REPLICA]

        async def load_until_two_replicas() -> set[str]:
            seen: set[str] = set()
            deadline = time.monotonic() + 120
            while len(seen) < 2 and time.monotonic() < deadline:
                seen.update(await asyncio.gather(*(replica_of(i) for i in range(12))))
            return seen

        seen = asyncio.run(load_until_two_replicas())
    finally:
        serve.shutdown()
        ray.shutdown()
    assert len(seen) == 2, seen
