"""OLMo 2: no norm before each sublayer but one after it, and one q norm and one k norm over
the whole projection rather than per head."""

from __future__ import annotations

from astrai.model.families.family import Family
from astrai.model.families.tensor_names import GGUF_POST_NORM_LAYER_NAMES, HF_POST_NORM_LAYER_NAMES

OLMO2 = Family(
    "olmo2",
    model_types=("olmo2",),
    architectures=("olmo2",),
    settings={"pre_norms": False, "post_norms": True, "qk_norm_across_heads": True},
    hf_layer_names=HF_POST_NORM_LAYER_NAMES,
    gguf_layer_names=GGUF_POST_NORM_LAYER_NAMES,
)
