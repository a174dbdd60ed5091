"""The paged decode attention kernel, bound to one step's decodes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from astrai.kernels import native

# The kernel's code for each dtype it reads: q and out may be of one, the cache of another.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class PagedDecode:
    """All decodes of a step, attended by the C kernel that reads their pages in place.

    On the CPU, for q and a cache each of fp32, bf16 or fp16, not necessarily the same (a bf16
    cache under an fp32 model halves the bytes read; keys and values are widened to fp32 as
    read, and all is computed in fp32 and rounded once, at the output). It needs no gather
    buffers and no grouping by context length, and each decode's result is independent of the
    batch. The page tables, context lengths and cache are resolved once per step into step,
    int64s the kernel reads at each call, so a layer's call is one C call, and a call bound to
    a persistent copy of step serves later steps (of another cache too).
    """

    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        key_ends: torch.Tensor | None = None,
    ):
        """rows [n]: each decode's row in the batch; block_tables [n, max_pages] (padded with
        page 0, contiguous) and context_lens [n]: each one's position + 1, the keys it sees,
        its own included; key_ends [n] (None: context_lens): where the keys it sees end, past
        its own for a row that sees later ones (the tokens of a Gemma 3 image), its window
        still counted from its own position."""
        # The kernel reads these through raw pointers: keep the tensors alive with the view.
        self.rows, self.block_tables, self.context_lens = rows, block_tables, context_lens
        self.key_ends = key_ends
        # k_cache, v_cache: [n_layers, n_pages, page_size, kvh, hd]
        self.kv_heads, self.head_dim = k_cache.shape[-2:]
        self.step = torch.tensor(
            [rows.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(), len(rows),
             block_tables.shape[1], k_cache.shape[2], k_cache.data_ptr(), v_cache.data_ptr(),
             k_cache.stride(0), DTYPE_CODES[k_cache.dtype],
             0 if key_ends is None else key_ends.data_ptr()],
            dtype=torch.int64,
        )  # fmt: skip

    @staticmethod
    def supports(k_cache: torch.Tensor) -> bool:
        """The kernel's rule: a CPU cache of fp32, bf16 or fp16 whose head_dim it reads 8 at a
        time (q, of any of the three, is checked by kernel_call)."""
        return (
            native.paged_attention is not None
            and k_cache.device.type == "cpu"
            and k_cache.dtype in DTYPE_CODES
            and k_cache.shape[-1] % 8 == 0
        )

    def kernel_call(
        self,
        layer_idx: int,
        q: torch.Tensor,
        out: torch.Tensor,
        k=None,
        v=None,
        *,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        step: torch.Tensor | None = None,
    ) -> Callable[[], None]:
        """The call that writes the decodes' attention outputs into out [num_tokens, heads, hd]:
        softmax(softcap * tanh(scale * q.k / softcap)) over the keys of the layer's cache at most
        window positions back (the model's LayerAttention).

        With k and v [num_tokens, kvh, hd] (of q's dtype) the kernel first stores the decodes'
        rows of them in the cache, rounded to its dtype; without, the caller has stored them.
        The call reads the decodes from step: self.step, or a persistent tensor of its shape
        that each later step refills (a recorded call).
        """
        if (
            q.dtype not in DTYPE_CODES
            or (k is not None and k.dtype != q.dtype)
            or (v is not None and v.dtype != q.dtype)
        ):
            raise ValueError(
                f"q, k and v must share one of {list(DTYPE_CODES)}, got {q.dtype}, "
                f"{None if k is None else k.dtype}, {None if v is None else v.dtype}"
            )
        placed = heads_contiguous(q, k, v, head_dim=self.head_dim)
        if step is not None and any(a is not b for a, b in zip(placed, (q, k, v), strict=True)):
            raise ValueError("a call kept for later steps must read q, k and v where they are")
        q, k, v = placed
        call = partial(
            native.paged_attention.decode,
            out.data_ptr(), q.data_ptr(), q.stride(0),
            0 if k is None else k.data_ptr(), 0 if k is None else k.stride(0),
            0 if v is None else v.data_ptr(), 0 if v is None else v.stride(0),
            layer_idx, (self.step if step is None else step).data_ptr(), q.shape[1],
            self.kv_heads, self.head_dim, scale, window or 0, softcap or 0.0, DTYPE_CODES[q.dtype],
        )  # fmt: skip
        call.keep_alive = (q, k, v, out)  # heads_contiguous's copies must outlive the call
        return call


def heads_contiguous(*tensors: torch.Tensor | None, head_dim: int) -> list[torch.Tensor | None]:
    """Each t [rows, heads, head_dim] with each row's heads in one run of values, as the kernel
    walks them (rows may lie any distance apart): t itself where it is, else a copy."""
    return [
        t if t is None or (t.stride(2) == 1 and t.stride(1) == head_dim) else t.contiguous()
        for t in tensors
    ]
