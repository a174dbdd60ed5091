"""Replicas of the astrai server behind Ray Serve's HTTP proxy, with prefix-affinity routing.

    serve run astrai.deploy:app model=HuggingFaceTB/SmolLM2-135M-Instruct num_replicas=2

Each replica (EngineReplica) loads one engine and the app `astrai serve` runs (create_app, from
the same flags), so every route, streaming, auth and error behaves as in `astrai serve`. The
ingress (Ingress) reads a request's body and hands the request to a replica chosen by Ray's
PrefixCacheAffinityRouter from the request's prompt text: a request sharing a long prefix with
an earlier one goes to the replica that served it, whose prefix cache holds that prefix's KV,
unless that replica is loaded beyond the others. The replica runs the request through its app
and streams the app's ASGI messages back, which the ingress sends on unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.routing import Router

from astrai.config import ConfigError

# The scope entries a replica's app reads; the rest (the ingress's router, state) stay behind.
_FORWARDED_SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "headers",
    "client",
    "server",
)
REPLICA_HEADER = b"x-astrai-replica"
# ray.serve.llm.request_router.PrefixCacheAffinityRouter is this class under a public name, but
# importing ray.serve.llm needs ray[llm] (vLLM, pyarrow); the class itself needs ray[serve] only.
PREFIX_AFFINITY_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
    ":PrefixCacheAffinityRouter"
)


@dataclass(frozen=True)
class ProxiedRequest:
    """One HTTP request on its way from the ingress to a replica.

    prompt is the text PrefixCacheAffinityRouter matches prefixes on (it reads an argument's
    `prompt` attribute): the system prompt and the messages' text, or a completion's prompt.
    """

    scope: dict
    body: bytes
    prompt: str


class EngineReplica:
    """One engine and the app serving it, answering the requests the ingress hands it."""

    def __init__(self, serve_flags: Sequence[str]) -> None:
        # Imported here, so the ingress, which shares this module, does not load torch.
        from astrai.flags import serve_settings
        from astrai.launch import open_server

        self.engine, self.app = open_server(*serve_settings(list(serve_flags)))
        self.name = serve.get_replica_context().replica_id.unique_id.encode()

    def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica: end the engine's scheduler thread.
        self.engine.close()

    async def __call__(self, request: ProxiedRequest) -> AsyncIterator[dict]:
        """Run request through the app, yielding the ASGI messages it sends; the response
        start names this replica in an x-astrai-replica header."""
        sent: asyncio.Queue[dict | None] = asyncio.Queue()
        client_gone = asyncio.Event()
        body = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive() -> dict:
            if body:
                return body.pop()
            # The app waits here to learn of a disconnect, which aborts its generation.
            await client_gone.wait()
            return {"type": "http.disconnect"}

        running = asyncio.ensure_future(self.app(dict(request.scope), receive, sent.put))
        running.add_done_callback(lambda _: sent.put_nowait(None))
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", ()), (REPLICA_HEADER, self.name)]
                    message = {**message, "headers": headers}
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    break
        finally:
            client_gone.set()
            await running


class Ingress:
    """Reads each request and streams it through the replica the request router picks."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self.replicas = replicas.options(stream=True)

    def __serve_build_asgi_app__(self) -> Router:
        # A Router without routes answers Ray's lifespan events and sends every request here.
        return Router(default=self.forward)

    async def forward(self, scope, receive, send) -> None:
        body = await Request(scope, receive).body()
        scope = {key: scope[key] for key in _FORWARDED_SCOPE_KEYS if key in scope}
        request = ProxiedRequest(scope, body, prompt_text(body))
        # The affinity router reads positional arguments only: a request without prompt text
        # (GET /v1/models, /metrics) goes as a keyword and is routed by load alone.
        if request.prompt:
            response = self.replicas.remote(request)
        else:
            response = self.replicas.remote(request=request)
        try:
            async for message in response:
                await send(message)
        finally:
            response.cancel()  # a client gone mid-stream stops the replica's generation


def prompt_text(body: bytes) -> str:
    """The text a request's output depends on first: its system prompt, then its messages'
    text (OpenAI or Anthropic), or a completion's prompt; "" for anything else."""
    try:
        request = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(request, dict):
        return ""
    messages = request.get("messages")
    if isinstance(messages, list):
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        return _text([request.get("system"), *contents])
    return _text(request.get("prompt"))


def _text(value: Any) -> str:
    """The text in a message content: a string, text parts, or lists of either."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(item) for item in value)
    if isinstance(value, dict):
        return _text(value.get("text")) or _text(value.get("content"))
    return ""


def build_app(
    model: str | None = None,
    *,
    serve_flags: Sequence[str] = (),
    num_replicas: int = 1,
    max_replicas: int | None = None,
    target_ongoing_requests: float | None = None,
    upscale_delay_s: float | None = None,
    max_ongoing_requests: int | None = None,
    replica_cpus: float = 1.0,
    replica_gpus: float = 0.0,
    prefix_affinity: bool = True,
    imbalanced_threshold: float | None = None,
) -> serve.Application:
    """The Ray Serve application: num_replicas engines behind one ingress.

    model and serve_flags are `astrai serve`'s --model and other flags (engine, auth, limits;
    not --port, since Ray's proxy listens; --shutdown-timeout is how long Ray lets a stopping
    replica's requests run); they are checked here, before any replica starts.
    With max_replicas, Ray Serve scales between num_replicas and max_replicas replicas to keep
    target_ongoing_requests in flight on each (default: the engine's max batch size), adding
    one once the load has stayed above that for upscale_delay_s seconds (Ray's default: 30).
    A replica takes at most max_ongoing_requests at once (default: twice the max batch size);
    Ray queues the rest. Each replica reserves replica_cpus CPUs (Ray sizes its torch thread
    pool to them) and replica_gpus GPUs (Ray sets CUDA_VISIBLE_DEVICES; `--device auto` then
    picks CUDA). With prefix_affinity a request goes to the replica that served the longest
    prefix of its prompt, unless the replicas' requests in flight differ by more than
    imbalanced_threshold (default: a quarter of the max batch size); then, and without
    prefix_affinity, to the less loaded of two random replicas.
    """
    from astrai.flags import serve_settings

    flags = ([] if model is None else ["--model", model]) + list(serve_flags)
    args, config = serve_settings(flags)
    _refuse_port(args, serve_settings([])[0])
    batch = config.max_batch_size
    if max_replicas is None:
        if num_replicas < 1:
            raise ConfigError(
                f"num_replicas must be at least 1, got {num_replicas}; to scale to zero, "
                "give max_replicas and num_replicas=0"
            )
        scaling: dict[str, Any] = {"num_replicas": num_replicas}
    else:
        if not 0 <= num_replicas <= max_replicas or max_replicas < 1:
            raise ConfigError(
                f"autoscaling needs 0 <= num_replicas <= max_replicas and max_replicas >= 1, "
                f"got num_replicas={num_replicas}, max_replicas={max_replicas}"
            )
        target = batch if target_ongoing_requests is None else target_ongoing_requests
        autoscaling = {
            "min_replicas": num_replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target,
        }
        if upscale_delay_s is not None:
            autoscaling["upscale_delay_s"] = upscale_delay_s
        scaling = {"autoscaling_config": autoscaling}
    if prefix_affinity:
        # Breaking affinity costs one prefill of the prefix on another replica, which then
        # holds it too; an idle replica costs throughput for as long as it lasts. With the max
        # batch size as threshold, 64 requests sharing a short system prompt went 59:5.
        threshold = max(1, batch // 4) if imbalanced_threshold is None else imbalanced_threshold
        router = RequestRouterConfig(
            request_router_class=PREFIX_AFFINITY_ROUTER,
            request_router_kwargs={"imbalanced_threshold": threshold, "do_eviction": True},
        )
    else:
        router = RequestRouterConfig()  # Ray's default: the less loaded of two random replicas
    per_replica = 2 * batch if max_ongoing_requests is None else max_ongoing_requests
    replicas = serve.deployment(
        EngineReplica,
        max_ongoing_requests=per_replica,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        request_router_config=router,
        # What --shutdown-timeout gives running requests in `astrai serve`.
        graceful_shutdown_timeout_s=args.shutdown_timeout,
        **scaling,
    )
    # The ingress only passes requests on: it takes as many as the replicas can (Ray's default
    # of 5 would hold the rest at the proxy while the replicas' batches stay half empty).
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        max_ongoing_requests=per_replica * max(num_replicas, max_replicas or 0),
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replicas.bind(flags))


def _refuse_port(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    """--port means nothing to a replica: Ray Serve's proxy is what listens."""
    if args.port != defaults.port:
        raise ConfigError(
            "--port has no effect on astrai.deploy's replicas: Ray Serve's proxy listens; "
            "set its port in serve.start(http_options=...) or the config file's http_options"
        )


class DeployArgs(BaseModel):
    """The key=value arguments of `serve run astrai.deploy:app`, as build_app takes them;
    serve_flags is one string of `astrai serve` flags, split as a shell would."""

    model: str | None = None
    serve_flags: str = ""
    num_replicas: int = 1
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    upscale_delay_s: float | None = None
    max_ongoing_requests: int | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    prefix_affinity: bool = True
    imbalanced_threshold: float | None = None


def app(args: dict[str, str]) -> serve.Application:
    """The application builder `serve run astrai.deploy:app key=value ...` calls with its
    key=value arguments; DeployArgs checks and converts them."""
    settings = DeployArgs.model_validate(args).model_dump()
    settings["serve_flags"] = shlex.split(settings["serve_flags"])
    return build_app(**settings)
