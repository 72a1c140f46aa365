"""memtrain's own GPT: a decoder-only transformer, the model the demo and most tests train.

The GPT follows GPT-2's shape (pre-norm blocks, learned positions, tied embeddings) and uses
``scaled_dot_product_attention`` so the fused kernels apply on GPU. Any model the trainer trains
maps token ids ``(B, T)`` to logits ``(B, T, V)``; one that wants activation checkpointing exposes
its repeated units as ``model.blocks`` (an ``nn.ModuleList``). A model may also compute its own
summed loss when called as ``model(idx, targets)`` and say so with ``computes_loss = True``: the
GPT does, so that its output projection and loss run chunked (``trainer.memory.loss``) and the full
logits never exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.memory.loss import linear_cross_entropy_sum
from trainer.models.sequence_split import SequenceSplit


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    # Set by trainer.parallel.sequence.apply_sequence_parallel: this rank holds a slice of each
    # row, and attends over the whole of it (None: whole rows).
    sequence: SequenceSplit | None = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x_BTC: torch.Tensor, mask_B1TT: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Causal attention; with ``mask_B1TT`` (``document_mask``), within each document."""
        B, T, C = x_BTC.shape
        q, k, v = self.qkv(x_BTC).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        if self.sequence is not None:
            y_BTHD = self.sequence.attend(q, k, v, mask_B1TT, dropout_p)
        else:
            y_BTHD = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask_B1TT,
                is_causal=mask_B1TT is None, dropout_p=dropout_p).transpose(1, 2)
        return self.proj(y_BTHD.contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask_B1TT: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask_B1TT)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    computes_loss = True  # model(idx, targets) returns the summed token loss
    # Set with its attention's by trainer.parallel.sequence.apply_sequence_parallel: the forward
    # takes this rank's slice of each row (None: whole rows).
    sequence: SequenceSplit | None = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.loss_chunk_tokens = 0  # set by trainer.memory.loss.set_loss_chunking; 0: plain loss
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)``, or with ``targets_BT`` the summed token loss (fp32 scalar).

        ``position_ids`` ``(B, T)``: packed documents' positions, restarting at 0 with each
        (``trainer.batches``): each token attends only within its own document. Under sequence
        parallelism (``sequence``) the inputs, targets and positions are this rank's slice of
        each row, and the result is that slice's."""
        T = idx_BT.shape[1]
        row_len = T if self.sequence is None else T * self.sequence.size
        if row_len > self.cfg.seq_len:
            raise ValueError(f"sequence length {row_len} exceeds the model's seq_len "
                             f"{self.cfg.seq_len}")
        mask = None
        if self.sequence is not None:
            pos, mask = self.sequence.positions(position_ids, T, idx_BT.device)
        elif position_ids is None:
            pos = torch.arange(T, device=idx_BT.device)
        else:
            pos, mask = position_ids, document_mask(position_ids)
        x = self.drop(self.wte(idx_BT) + self.wpe(pos))
        for block in self.blocks:
            x = block(x, mask)
        x = self.ln_f(x)
        if targets_BT is None:
            return self.lm_head(x)
        return linear_cross_entropy_sum(x.flatten(0, 1), self.lm_head.weight,
                                        targets_BT.flatten(), self.loss_chunk_tokens)

    @property
    def vocab_size(self) -> int:
        """The output vocabulary (``memory.loss_chunk_tokens: auto`` sizes its chunks by it)."""
        return self.cfg.vocab_size

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12·L·T·C."""
        n = self.num_params() - self.wpe.weight.numel()
        return 6 * n + 12 * self.cfg.n_layer * self.cfg.seq_len * self.cfg.n_embd


def document_mask(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool: query ``i`` may attend to key ``j`` where ``j <= i`` and both are
    in the same document (a document starts where its position is 0). B x T x T bytes, which
    the planner's probe measures with the rest of the step."""
    documents_BT = (position_ids_BT == 0).cumsum(dim=1)
    T = position_ids_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=position_ids_BT.device).tril()
    same_BTT = documents_BT.unsqueeze(2) == documents_BT.unsqueeze(1)
    return (same_BTT & causal_TT).unsqueeze(1)


