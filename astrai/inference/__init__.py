"""The engine: paged KV cache, continuous-batching scheduler, sampling, streaming."""

from astrai.inference.engine import (
    EngineStats,
    GenerationRequest,
    InferenceEngine,
    RequestStream,
    StreamEvent,
)
from astrai.inference.sample import (
    BaseSamplingStrategy,
    SamplingPipeline,
    TemperatureStrategy,
    TopKStrategy,
    TopPStrategy,
    sample,
)
from astrai.inference.scheduler import InferenceScheduler
from astrai.inference.task import (
    STOP,
    GenerationParams,
    Task,
    TaskDelta,
    TaskResult,
    TaskStatus,
    TokenLogprob,
)

__all__ = [
    "STOP",
    "BaseSamplingStrategy",
    "EngineStats",
    "GenerationParams",
    "GenerationRequest",
    "InferenceEngine",
    "InferenceScheduler",
    "RequestStream",
    "SamplingPipeline",
    "StreamEvent",
    "Task",
    "TaskDelta",
    "TaskResult",
    "TaskStatus",
    "TemperatureStrategy",
    "TokenLogprob",
    "TopKStrategy",
    "TopPStrategy",
    "sample",
]
