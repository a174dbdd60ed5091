"""The FastAPI app: OpenAI, Responses, Anthropic, Ollama, tokenizer and embeddings routers,
auth, errors, /health, /metrics and /version, serving one loaded model (create_app) or several
loaded on demand (create_router_app)."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

import astrai
from astrai.inference import InferenceEngine
from astrai.server import (
    anthropic_api,
    defaults,
    embeddings_api,
    lora_api,
    ollama_api,
    openai_api,
    responses_api,
    tokenizer_api,
)
from astrai.server.auth import WEBUI_FILES, WEBUI_PAGE, APIKeyAuth
from astrai.server.errors import APIError, error_response
from astrai.server.generation import GenerationService
from astrai.server.hosts import HostCheck
from astrai.server.lifecycle import Drain, DrainGate
from astrai.server.limits import RequestBodyLimit
from astrai.server.media import MediaFetcher
from astrai.server.metrics import RequestCounter, ServerMetrics
from astrai.server.reasoning import reasoning_parser_for
from astrai.server.registry import ModelLeases, ModelRegistry, ServedModel
from astrai.server.tool_parsers import tool_call_parser_for

log = logging.getLogger(__name__)

WEBUI_DIR = Path(__file__).resolve().parent / "webui"


@dataclass(frozen=True)
class ModelSource:
    """A model a router app loads on demand: its served name, its file or directory, and load,
    which builds its engine (in a worker thread) and returns it with the sampling settings a
    request that leaves them out gets."""

    name: str
    path: Path
    load: Callable[[], tuple[InferenceEngine, dict]]


class _ServiceMaker:
    """Builds each model's GenerationService with what all of an app's models share: the
    metrics, the tool-call and reasoning parsers named, and the hosts images may be fetched
    from (allowed_domains, each fetch within timeout seconds; none: image URLs are refused)."""

    def __init__(
        self,
        tool_call_parser: str | None,
        reasoning_parser: str | None,
        allowed_domains: Sequence[str],
        timeout: float,
    ) -> None:
        self.metrics = ServerMetrics()
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.allowed_domains = frozenset(domain.lower() for domain in allowed_domains)
        self.timeout = timeout

    def service(
        self, engine: InferenceEngine, name: str, sampling: dict | None
    ) -> GenerationService:
        templates = engine.tokenizer.chat_templates.values()
        return GenerationService(
            engine,
            name,
            self.metrics,
            tool_call_parser_for(self.tool_call_parser, templates),
            reasoning_parser_for(self.reasoning_parser, templates),
            sampling,
            self._media_fetcher(engine),
        )

    def _media_fetcher(self, engine: InferenceEngine) -> MediaFetcher | None:
        """The fetcher of images from the allowed hosts (at most the engine's image byte
        limit), None where no host is allowed."""
        if not self.allowed_domains:
            return None
        return MediaFetcher(self.allowed_domains, engine.config.max_image_bytes, self.timeout)

    def load(self, source: ModelSource) -> GenerationService:
        engine, sampling = source.load()
        try:
            return self.service(engine, source.name, sampling)
        except BaseException:
            engine.close()
            raise


def create_app(
    engine: InferenceEngine,
    model_name: str,
    api_key: str | None = None,
    *,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    allowed_media_domains: Sequence[str] = (),
    media_fetch_timeout: float = defaults.MEDIA_FETCH_TIMEOUT,
    lora_dir: str | None = None,
    sampling: dict | None = None,
    **options,
) -> FastAPI:
    """An app serving one loaded engine under model_name.

    tool_call_parser names the format tool calls are read in (astrai.server.tool_parsers.PARSERS);
    without it the chat template shows it, or chat requests with tools are refused.
    reasoning_parser names the format of the model's think blocks (astrai.server.reasoning.PARSERS),
    which answers give apart from the text; without it a chat template that mentions <think>
    picks the think parser. allowed_media_domains are the hosts images may be fetched from by
    their http(s) URLs (astrai.server.media), each within media_fetch_timeout seconds; with
    none, such URLs are refused. lora_dir allows POST /v1/load_lora_adapter to load adapters
    found below it. sampling holds the GenerationParams settings a request that leaves them
    out gets (the engine's defaults for those it lacks). options are _app's.
    """
    maker = _ServiceMaker(
        tool_call_parser, reasoning_parser, allowed_media_domains, media_fetch_timeout
    )
    service = maker.service(engine, model_name, sampling)
    models = ModelRegistry([ServedModel(model_name, service=service)])
    app = _app(models, maker.metrics, api_key, **options)
    app.state.lora_dir = None if lora_dir is None else Path(lora_dir).resolve()
    return app


def create_router_app(
    sources: Sequence[ModelSource],
    api_key: str | None = None,
    *,
    max_loaded_models: int | None = None,
    idle_unload: float | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    allowed_media_domains: Sequence[str] = (),
    media_fetch_timeout: float = defaults.MEDIA_FETCH_TIMEOUT,
    **options,
) -> FastAPI:
    """An app serving several models, each loaded when a request names it (ModelRegistry): at
    most max_loaded_models at once (default: all), each unloaded after idle_unload seconds
    unused (default: never). The parsers and media hosts named apply to every model, as
    create_app's; options are _app's."""
    maker = _ServiceMaker(
        tool_call_parser, reasoning_parser, allowed_media_domains, media_fetch_timeout
    )
    models = ModelRegistry(
        [ServedModel(s.name, load=functools.partial(maker.load, s), path=s.path) for s in sources],
        max_loaded_models,
        idle_unload,
    )
    app = _app(models, maker.metrics, api_key, **options)
    app.state.lora_dir = None
    return app


def _app(
    models: ModelRegistry,
    metrics: ServerMetrics,
    api_key: str | None = None,
    *,
    allowed_hosts: Sequence[str] = (),
    max_request_bytes: int = defaults.MAX_REQUEST_BYTES,
    read_timeout: float = defaults.READ_TIMEOUT,
    docs: bool = False,
    webui: bool = True,
) -> FastAPI:
    """The app serving models.

    api_key guards every endpoint but /health and /metrics. Requests must name a loopback host,
    an IP address or one of allowed_hosts ("*" allows any). A body must be at most
    max_request_bytes and arrive within read_timeout seconds. /docs, /redoc and /openapi.json
    exist only with docs, behind the key when there is one. webui serves the chat page
    (astrai/server/webui) at / and its files under /webui/, without the key (the page asks for
    it and sends it with its API calls).
    """
    doc_urls = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="astrai", version=astrai.__version__, **({} if docs else doc_urls))
    metrics.watch(models)
    app.state.models = models
    app.state.drain = Drain(models)
    app.state.responses = responses_api.ResponseStore()
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)
    app.include_router(ollama_api.router)
    app.include_router(tokenizer_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(embeddings_api.ollama_router)
    app.include_router(lora_api.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        loaded = models.loaded()
        stopped = [model.name for model in loaded if not model.service.engine.is_running]
        if not models.loads_on_demand:
            [model] = loaded
            status = "engine stopped" if stopped else "ok"
            return JSONResponse({"status": status, "model": model.name}, 503 if stopped else 200)
        if stopped:
            return JSONResponse({"status": "engine stopped", "models": stopped}, 503)
        return JSONResponse({"status": "ok", "loaded": [model.name for model in loaded]})

    @app.get("/version")
    async def version() -> dict:
        return {"version": astrai.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if webui:

        @app.get(WEBUI_PAGE, include_in_schema=False)
        async def chat_page() -> FileResponse:
            return FileResponse(WEBUI_DIR / "index.html")

        app.mount(WEBUI_FILES.rstrip("/"), StaticFiles(directory=WEBUI_DIR), name="webui")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return error_response(request.url.path, APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(request.url.path, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        # The exception's text describes the code, not the request: it goes to the log only.
        error_id = uuid.uuid4().hex[:12]
        log.exception("request to %s failed (error id %s)", request.url.path, error_id)
        message = f"the server failed on this request (error id {error_id}); its log says why"
        return error_response(request.url.path, APIError(500, message))

    # The last added runs first: count every request, then check its Host, refuse it while
    # shutting down, check its key, only then read its body, and release the models it held
    # once its response is sent.
    app.add_middleware(ModelLeases, registry=models)
    app.add_middleware(RequestBodyLimit, max_bytes=max_request_bytes, timeout=read_timeout)
    if api_key:
        app.add_middleware(APIKeyAuth, api_key=api_key, webui=webui)
    app.add_middleware(DrainGate, drain=app.state.drain)
    if "*" not in allowed_hosts:
        app.add_middleware(HostCheck, allowed_hosts=allowed_hosts)
    routers = (
        openai_api.router,
        anthropic_api.router,
        responses_api.router,
        ollama_api.router,
        tokenizer_api.router,
        embeddings_api.router,
        embeddings_api.ollama_router,
        lora_api.router,
        app.router,
    )
    routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    app.add_middleware(RequestCounter, metrics=metrics, routes=routes)
    return app


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A message naming each bad field (up to three) and the first field's dotted path."""
    if errors and errors[0]["type"] == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    fields, parts = [], []
    for error in errors[:3]:
        name = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
        fields.append(name)
        if error["type"] == "extra_forbidden":
            parts.append(f"{name}: astrai does not know this field; leave it out (docs/api.md)")
        else:
            parts.append(f"{name}: {error['msg']}")
    return "invalid request: " + "; ".join(parts), fields[0] if fields else None
