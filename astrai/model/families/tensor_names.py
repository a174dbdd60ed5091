"""The tensor names of the checkpoints astrai reads, as the family records map them.

A native tensor (astrai's own name, below layers.N.) is made of one or more Hugging Face
tensors, concatenated along dim 0; a GGUF file names each Hugging Face tensor its own way.
The tables here are the Llama decoder's; a family whose checkpoints differ has its own.
"""

from __future__ import annotations

import re

# Native name (below layers.N.) -> the HF tensors it is made of, concatenated along dim 0.
HF_LAYER_NAMES = {
    "attention_norm.weight": ("input_layernorm.weight",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
    "attention.wqkv.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "attention.wqkv.bias": tuple(f"self_attn.{p}_proj.bias" for p in "qkv"),
    "attention.wo.weight": ("self_attn.o_proj.weight",),
    "attention.q_norm.weight": ("self_attn.q_norm.weight",),
    "attention.k_norm.weight": ("self_attn.k_norm.weight",),
    "feed_forward.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "feed_forward.w2.weight": ("mlp.down_proj.weight",),
    # Mixture of experts: one entry serves every expert, its index written {e}.
    "feed_forward.router.weight": ("mlp.gate.weight",),
    "feed_forward.experts.{e}.w13.weight": (
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
    ),
    "feed_forward.experts.{e}.w2.weight": ("mlp.experts.{e}.down_proj.weight",),
    "feed_forward.shared_expert.w13.weight": (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    ),
    "feed_forward.shared_expert.w2.weight": ("mlp.shared_expert.down_proj.weight",),
    "feed_forward.shared_expert_gate.weight": ("mlp.shared_expert_gate.weight",),
}
# With post-norms (OLMo 2, Gemma) HF's post_attention_layernorm norms the attention's output,
# and the feed-forward has a pre_ (Gemma) and a post_feedforward_layernorm of its own.
HF_POST_NORM_LAYER_NAMES = {
    **HF_LAYER_NAMES,
    "ffn_norm.weight": ("pre_feedforward_layernorm.weight",),
    "post_attention_norm.weight": ("post_attention_layernorm.weight",),
    "post_ffn_norm.weight": ("post_feedforward_layernorm.weight",),
}
HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Hugging Face tensor name (below model.layers.N.) -> GGUF name (below blk.N.).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{w}": f"attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Experts as llama.cpp's first Mixtral files held them, one tensor each: the GGUF reader
    # splits the 3-D tensors of today's files (ffn_gate_exps, ...) into these.
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.{e}.gate_proj.weight": "ffn_gate.{e}.weight",
    "mlp.experts.{e}.up_proj.weight": "ffn_up.{e}.weight",
    "mlp.experts.{e}.down_proj.weight": "ffn_down.{e}.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# With post-norms HF's post_attention_layernorm norms the attention's output.
GGUF_POST_NORM_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
GGUF_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def expert_template(name: str) -> tuple[str, str | None]:
    """(name with its expert index written {e}, as the name tables spell every expert's
    tensors once, and that index), or (name, None) for a tensor of no expert."""
    expert = re.search(r"(?<=experts\.)\d+(?=\.)", name)
    if expert is None:
        return name, None
    return name.replace(f"experts.{expert[0]}.", "experts.{e}."), expert[0]
