"""The engine: paged KV cache, continuous-batching scheduler, sampling, streaming.

The names are imported on first use, so that astrai.inference.task (GenerationParams, the
request errors) loads without torch: `astrai --help` builds its flags from GenerationParams.
"""

from __future__ import annotations

import importlib
import sys
import types

_EXPORTS = {
    "EngineStats": "astrai.inference.engine",
    "GenerationRequest": "astrai.inference.engine",
    "InferenceEngine": "astrai.inference.engine",
    "RequestStream": "astrai.inference.engine",
    "StreamEvent": "astrai.inference.engine",
    "SyncRequestStream": "astrai.inference.engine",
    "BaseSamplingStrategy": "astrai.inference.sample",
    "SamplingPipeline": "astrai.inference.sample",
    "TemperatureStrategy": "astrai.inference.sample",
    "TopKStrategy": "astrai.inference.sample",
    "TopPStrategy": "astrai.inference.sample",
    "sample": "astrai.inference.sample",
    "InferenceScheduler": "astrai.inference.scheduler",
    "STOP": "astrai.inference.task",
    "EngineClosedError": "astrai.inference.task",
    "GenerationError": "astrai.inference.task",
    "GenerationParams": "astrai.inference.task",
    "InvalidParamsError": "astrai.inference.task",
    "PromptTooLongError": "astrai.inference.task",
    "QueueFullError": "astrai.inference.task",
    "RequestAbortedError": "astrai.inference.task",
    "RequestError": "astrai.inference.task",
    "Task": "astrai.inference.task",
    "TaskDelta": "astrai.inference.task",
    "TaskResult": "astrai.inference.task",
    "TaskStatus": "astrai.inference.task",
    "TokenLogprob": "astrai.inference.task",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'astrai.inference' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


class _Package(types.ModuleType):
    """This package, whose `sample` stays the function: loading the submodule of that name
    sets the package's attribute to the module, which would hide the function from
    __getattr__."""

    @property
    def sample(self):
        return importlib.import_module("astrai.inference.sample").sample

    @sample.setter
    def sample(self, module: types.ModuleType) -> None:
        """The import system's binding of the submodule; the function stays."""


sys.modules[__name__].__class__ = _Package
