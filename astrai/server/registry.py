"""The models one server serves, by name, each loaded when a request names it (llama.cpp's router
mode, Ollama's model management).

A request's model field picks its model through model_service, which every route calls. A model
that is not loaded is loaded in a worker thread while the event loop goes on serving; requests
for a model that is loading wait for it. At most max_loaded models are loaded at once: a load
past that unloads the least recently used model that no request is using, or waits until one is
free. A model unused for idle_unload seconds is unloaded, or for as long as its last request's
keep_alive says (Ollama's: 0 unloads it once that request is answered, a negative time never).
Unloading closes the engine and drops every reference to it, so its memory goes back to the
system.

A request holds its model from model_service until its response has been sent, streams
included (ModelLeases, the middleware, lets it go), so no model is unloaded under a request.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from astrai.server.errors import APIError
from astrai.server.generation import GenerationService, unknown_model

log = logging.getLogger(__name__)

# The ASGI scope key of the models a request holds (ModelLeases's list).
LEASES = "astrai.model_leases"


@dataclass(eq=False)
class ServedModel:
    """One model of a server: its name, how to load it, and its service while it is loaded.

    load builds the service (in a worker thread); None for a model given loaded, which stays
    loaded. path is the file or directory it is loaded from, for the lists' sizes and dates.
    """

    name: str
    load: Callable[[], GenerationService] | None = None
    path: Path | None = None
    service: GenerationService | None = None
    loading: asyncio.Future | None = None
    unloading: bool = False  # its engine is closing, its memory not yet given back
    leases: int = 0  # requests holding it
    last_used: float = field(default_factory=time.monotonic)
    # Seconds it stays loaded once idle, as its last request's keep_alive set them (math.inf:
    # for ever); None: the server's idle_unload.
    keep_alive: float | None = None
    _idle_timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def status(self) -> str:
        """loaded, loading or unloaded, as llama.cpp's router lists them, or unloading."""
        if self.service is not None:
            return "loaded"
        if self.loading is not None:
            return "loading"
        return "unloading" if self.unloading else "unloaded"

    def disk_bytes(self) -> int:
        """The bytes its files take on disk (0 for a model given loaded)."""
        if self.path is None:
            return 0
        if self.path.is_file():
            return self.path.stat().st_size
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def modified(self) -> float:
        """When its files last changed (seconds since the epoch), else when it was loaded."""
        if self.path is None:
            return self.service.created
        return self.path.stat().st_mtime


class ModelRegistry:
    """The served models by name, loaded on demand within max_loaded, unloaded when idle."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        max_loaded: int | None = None,
        idle_unload: float | None = None,
    ) -> None:
        self.models = {model.name: model for model in models}
        if len(self.models) != len(models):
            names = [model.name for model in models]
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"two models go by the name {twice[0]!r}; rename one")
        self.max_loaded = max_loaded or len(self.models)
        self.idle_unload = idle_unload
        self.stopping = False
        # Models loaded or loading, or unloading and not yet closed: each holds memory.
        self._slots_taken = sum(model.service is not None for model in self.models.values())
        self._slot_freed = asyncio.Event()

    @property
    def loads_on_demand(self) -> bool:
        """Whether models come and go (a router), rather than one model given loaded."""
        return any(model.load is not None for model in self.models.values())

    def loaded(self) -> list[ServedModel]:
        return [model for model in self.models.values() if model.service is not None]

    def served_names(self) -> list[str]:
        """The names a request's model field may take: each model's, and after a loaded
        model's, its LoRA adapters'."""
        names = []
        for model in self.models.values():
            names.extend([model.name] if model.service is None else model.service.served_models())
        return names

    def find(self, requested: str | None) -> ServedModel:
        """The model requested names (itself or one of its adapters); a 404 naming the served
        ones for a name none goes by. None names the one model of a server that has one."""
        if requested is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise APIError(
                400,
                f"this server serves several models; name one in the model field: "
                f"{self.served_names()}",
                param="model",
            )
        if requested in self.models:
            return self.models[requested]
        for model in self.loaded():
            if requested in model.service.served_models():
                return model
        raise unknown_model(requested, self.served_names())

    def sole_service(self) -> GenerationService:
        """The service of a server with one model given loaded, for what only it supports
        (LoRA adapters loaded through the API); a 400 on a router."""
        if self.loads_on_demand:
            raise APIError(
                400,
                "LoRA adapters load into a server of one model (astrai serve --model); this "
                "server loads several models on demand",
            )
        [model] = self.models.values()
        return model.service

    def idle_seconds(self, model: ServedModel) -> float | None:
        """How long model stays loaded once no request holds it; None: until the server stops."""
        if model.load is None:
            return None
        seconds = self.idle_unload if model.keep_alive is None else model.keep_alive
        return None if seconds is None or math.isinf(seconds) else seconds

    async def acquire(
        self, requested: str | None, leases: list[ServedModel], keep_alive: float | None = None
    ) -> GenerationService:
        """The service of the model requested names, loaded first if it is not; the model is
        held (added to leases, released by release) so that it stays loaded meanwhile, and for
        keep_alive seconds after (None: the server's idle_unload; math.inf: for ever)."""
        model = self.find(requested)
        self._keep(model, keep_alive)
        model.leases += 1
        leases.append(model)
        while model.service is None:
            if self.stopping:
                raise APIError(503, "the server is shutting down and loads no more models")
            if model.loading is None:
                model.loading = asyncio.ensure_future(self._load(model))
            # Shielded: a client that goes away leaves the load to the requests that wait for it.
            await asyncio.shield(model.loading)
        model.last_used = time.monotonic()
        return model.service

    async def unload(self, requested: str | None) -> None:
        """Unload the model requested names now, or once the requests holding it are answered
        (Ollama's keep_alive 0 without a prompt); nothing to do for one that is not loaded."""
        model = self.find(requested)
        self._keep(model, 0.0)
        if model.service is not None and model.leases == 0:
            await self._unload(model)

    def _keep(self, model: ServedModel, keep_alive: float | None) -> None:
        """Set how long model stays loaded once idle; a model given loaded (a server of one
        model) stays loaded while the server runs, so it takes only a keep_alive of for ever."""
        if model.load is None and keep_alive is not None and not math.isinf(keep_alive):
            raise APIError(
                400,
                f"keep_alive asks to unload the model {model.name!r} after {keep_alive:g}s, but a "
                "server of one model (astrai serve --model) keeps it loaded while it runs; leave "
                "keep_alive out or send -1, or serve models that load and unload on demand with "
                "astrai serve --models-dir",
                param="keep_alive",
            )
        model.keep_alive = keep_alive

    def release(self, model: ServedModel) -> None:
        """A request is done with model; once none holds it, its idle time starts."""
        model.leases -= 1
        model.last_used = time.monotonic()
        if model.leases == 0:
            self._now_idle(model)

    def _now_idle(self, model: ServedModel) -> None:
        """No request holds model now: a load waiting for a slot may unload it, and its idle
        timer starts."""
        self._slot_freed.set()
        if model._idle_timer is not None:
            model._idle_timer.cancel()
            model._idle_timer = None
        seconds = self.idle_seconds(model)
        if seconds is not None:
            loop = asyncio.get_running_loop()
            model._idle_timer = loop.call_later(seconds, self._unload_if_idle, model)

    async def _load(self, model: ServedModel) -> None:
        """Load model once a slot is free, unloading the least recently used idle model for
        one if all are taken."""
        try:
            while self._slots_taken >= self.max_loaded:
                idle = [m for m in self.loaded() if m.leases == 0 and m.load is not None]
                if idle:
                    await self._unload(min(idle, key=lambda m: m.last_used))
                    continue
                self._slot_freed.clear()
                await self._slot_freed.wait()
            self._slots_taken += 1
            log.info("loading model %r", model.name)
            started = time.perf_counter()
            try:
                service = await asyncio.to_thread(model.load)
            except BaseException:
                self._free_slot()
                raise
        except Exception as exc:
            log.exception("model %r failed to load", model.name)
            raise APIError(
                500, f"the model {model.name!r} failed to load; the server log says why"
            ) from exc
        finally:
            model.loading = None
        log.info("loaded model %r in %.1fs", model.name, time.perf_counter() - started)
        model.service = service
        if self.stopping:
            service.stop_running()
        if model.leases == 0:  # every request that asked for it has gone meanwhile
            self._now_idle(model)

    def _unload_if_idle(self, model: ServedModel) -> None:
        """The idle timer's end: every release restarts the timer, so no request has used the
        model since, unless one holds it now."""
        model._idle_timer = None
        if model.service is not None and model.leases == 0:
            log.info("model %r idle for %gs", model.name, self.idle_seconds(model))
            self._unload(model)

    def _unload(self, model: ServedModel) -> asyncio.Future:
        """Take model's service away now, before any other request can get it, and close its
        engine in a worker thread (the future returned); its slot is free once it is closed."""
        engine, model.service = model.service.engine, None
        model.unloading = True
        log.info("unloading model %r", model.name)
        return asyncio.ensure_future(self._close(model, engine))

    async def _close(self, model: ServedModel, engine) -> None:
        try:
            await asyncio.to_thread(engine.close)
        finally:
            del engine  # the last reference: the weights and the KV pool can go
            await asyncio.to_thread(gc.collect)  # and whatever only reference cycles still hold
            model.unloading = False
            self._free_slot()

    def _free_slot(self) -> None:
        self._slots_taken -= 1
        self._slot_freed.set()

    def stop_running(self) -> None:
        """Refuse new loads and end every running generation with the shutting-down error."""
        self.stopping = True
        for model in self.loaded():
            model.service.stop_running()

    def close(self) -> None:
        """Close every loaded model's engine (the server has stopped)."""
        for model in self.loaded():
            engine, model.service = model.service.engine, None
            engine.close()


async def model_service(
    request: Request, requested: str | None, keep_alive: float | None = None
) -> GenerationService:
    """The service of the model a request's model field names (loaded first if it is not), held
    until the response has been sent and for keep_alive seconds after (ModelRegistry.acquire);
    a 404 naming the served models for a name none goes by."""
    registry: ModelRegistry = request.app.state.models
    return await registry.acquire(requested, request.scope[LEASES], keep_alive)


class ModelLeases:
    """ASGI middleware: releases the models a request acquired once its response is sent."""

    def __init__(self, app, registry: ModelRegistry) -> None:
        self.app = app
        self.registry = registry

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases = scope[LEASES] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for model in leases:
                self.registry.release(model)
