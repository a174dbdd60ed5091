"""astrai: a small, fast and correct LLM inference engine on PyTorch."""

from astrai.threads import configure_openmp

configure_openmp()

__version__ = "0.1.0"
