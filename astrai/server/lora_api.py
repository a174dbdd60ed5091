"""vLLM's routes that load and unload LoRA adapters while the server runs.

A request names an adapter by its model field once it is loaded. Loading reads files on the
server, so it is allowed only below the directory the operator gave (--lora-dir), and, as
every route but /health and /metrics, only with the API key when there is one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from astrai.config import ConfigError
from astrai.model.lora import UnknownAdapterError
from astrai.server.errors import APIError
from astrai.server.generation import GenerationService
from astrai.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

router = APIRouter()


def _service(request: Request) -> GenerationService:
    """The one model's service: adapters load into a server of one model only."""
    return request.app.state.models.sole_service()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    service = _service(request)
    lora_dir: Path | None = request.app.state.lora_dir
    if lora_dir is None:
        raise APIError(
            403,
            "loading adapters through the API is off: start astrai serve with --lora-dir DIR "
            "to allow adapters below DIR",
        )
    path = (lora_dir / body.lora_path).resolve()
    if not path.is_relative_to(lora_dir):
        raise APIError(
            403,
            f"lora_path {body.lora_path!r} lies outside the server's --lora-dir; give a path "
            "below it (relative paths are taken from it)",
            param="lora_path",
        )
    if body.lora_name in service.served_models():
        raise APIError(
            400,
            f"the name {body.lora_name!r} is served already; unload it first",
            param="lora_name",
        )
    try:
        await asyncio.to_thread(service.engine.load_adapter, body.lora_name, str(path))
    except ConfigError as exc:
        raise APIError(400, str(exc), param="lora_path") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, request: Request
) -> PlainTextResponse:
    service = _service(request)
    try:
        service.engine.unload_adapter(body.lora_name)
    except UnknownAdapterError as exc:
        raise APIError(404, str(exc), param="lora_name", code="model_not_found") from exc
    except ConfigError as exc:
        raise APIError(400, str(exc), param="lora_name") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
