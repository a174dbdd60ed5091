"""astrai: a small, fast and correct LLM inference engine on PyTorch."""

__version__ = "0.1.0"
