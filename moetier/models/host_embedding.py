"""Token embeddings kept in pinned RAM when the GPU's budget is tight (llama.cpp keeps `token_embd` on the host too).

Why: a decode token reads one row of the table (Qwen3-30B-A3B: 4 KiB of 622 MiB bf16; DeepSeek-V3: 14 KiB of
1.85 GiB), so holding the table in VRAM buys nothing but takes memory the expert cache could use (at
`--gpu-mem 8GiB` on Qwen3-30B-A3B, 622 MiB are ~234 more cached experts). The rows are gathered by a GPU kernel
reading the pinned table over PCIe (unified addressing, as the doorbell kernels read their host buffers): one
launch, no host sync, CUDA-graph capturable. A prefill chunk of 8192 tokens reads 32 MiB over PCIe (~0.6 ms).

`HostEmbedding(weight)` replaces nn.Embedding: `weight` [V, D] float in host memory (pinned when CUDA is there),
forward(tokens [T] on any device) -> [T, D] on the tokens' device. The memory plan decides (plan.host_embedding):
on CUDA with memory tiers, unless `--gpu-embed` (a tied lm_head is loaded as its own copy either way).
"""
from __future__ import annotations

import torch
from torch import nn


class HostEmbedding(nn.Module):
    """nn.Embedding whose table stays in (pinned) host memory; rows are gathered to the tokens' device."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"HostEmbedding wants a [V, D] table in host memory, got {tuple(weight.shape)} on "
                             f"{weight.device}")
        self.weight = weight            # a plain attribute: model.to() / the loader's buffer moves leave it here
        self.num_embeddings, self.embedding_dim = weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from ..kernels import ops
        return ops.embed_rows(self.weight, tokens)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, host (pinned={self.weight.is_pinned()})"
