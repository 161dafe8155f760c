"""A small decoder-only transformer in the nanoGPT tradition, with a Hugging Face style forward.

Pre-LN blocks, causal self-attention through ``F.scaled_dot_product_attention`` (flash / memory-efficient
kernels where the device has them), GELU MLP, tied input/output embeddings, and nanoGPT's initialisation
(N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2 * n_layer), GPT-2 paper section 2.3).

Nothing here chooses a precision: run the model under ``torch.autocast`` (a ``Precision.autocast()``) and the
matmuls take the autocast dtype while the parameters stay fp32. The loss is always computed from logits cast
to fp32, because a softmax over 256+ classes in fp16 loses the small probabilities the gradient needs.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from mixprec.models.causal_lm_output import CausalLMOutput
from mixprec.models.chunked_loss import linear_cross_entropy
from mixprec.models.gpt_config import GPT_PRESETS, GPTConfig

__all__ = ["GPT"]

IGNORE_INDEX = -100
"""Label value that contributes nothing to the loss (the Hugging Face / PyTorch convention)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.track_logit_max = False
        """Keep the largest attention logit of each forward in :attr:`logit_max` (the precision watch turns it
        on for its sampled steps: an extra q @ k^T, the cost of the fused kernel's own, no host sync)."""
        self.logit_max: torch.Tensor | None = None
        """Running max of q . k / sqrt(head_dim) over the forwards since the reader last set it to None."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.track_logit_max:
            self._track_logit_max(q, k, attn_mask)
        dropout_p = self.dropout if self.training else 0.0
        # is_causal without an explicit mask keeps the flash kernel eligible
        y = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p=dropout_p, is_causal=attn_mask is None)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    @torch.no_grad()
    def _track_logit_max(self, q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> None:
        # the fused kernel never materialises the scores, so the attention-logit-growth precursor (Wortsman et
        # al. 2023) recomputes them, in fp32 (on the watch's sampled steps only; no host sync)
        # over the positions softmax really sees, a few sequences at a time (scores of at most 2^26 elements)
        B, H, T, _ = q.shape
        visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if attn_mask is None else attn_mask
        step = max(1, 2**26 // (H * T * T))
        maxima = []
        for i in range(0, B, step):
            scores = (q[i : i + step].float() @ k[i : i + step].float().transpose(-2, -1)) * (q.size(-1) ** -0.5)
            mask = visible if visible.dim() == 2 else visible[i : i + step]
            maxima.append(scores.masked_fill(~mask, float("-inf")).amax())
        m = torch.stack(maxima).amax()
        self.logit_max = m if self.logit_max is None else torch.maximum(self.logit_max, m)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``model(input_ids, labels=None, attention_mask=None) -> CausalLMOutput``.

    Build one with ``GPT(GPTConfig(...))`` or ``GPT.from_preset("small", dropout=0.1)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.gradient_checkpointing = False
        self._checkpoint_kwargs: dict[str, Any] = {}
        # weight tying (Press & Wolf 2017): one matrix embeds and un-embeds, saving vocab * n_embd params
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) so the residual stream's variance does
        # not grow with depth (two residual adds per block)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPT:
        """A model of the named shape (``GPT_PRESETS``); keyword overrides replace config fields."""
        if name not in GPT_PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of: {', '.join(GPT_PRESETS)}")
        valid = {f.name for f in fields(GPTConfig)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(
                f"unknown GPTConfig field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(valid))}"
            )
        return cls(replace(GPT_PRESETS[name], **overrides))

    def num_parameters(
        self,
        exclude_position_embeddings: bool = False,
        *,
        only_trainable: bool = False,
        exclude_embeddings: bool = False,
    ) -> int:
        """Number of distinct parameters (the tied embedding counted once).

        ``exclude_position_embeddings=True`` is nanoGPT's "non-embedding" count, the N of the 6N FLOP rule:
        the token embedding stays because, tied to ``lm_head``, it does a matmul every step.
        ``only_trainable`` and ``exclude_embeddings`` are HF ``PreTrainedModel.num_parameters``'s keywords
        (the HF Trainer calls it with them); the latter leaves out both embeddings.
        """
        params = [p for p in self.parameters() if p.requires_grad or not only_trainable]
        n = sum(p.numel() for p in params)  # parameters() already yields a tied tensor once
        if exclude_embeddings:
            n -= self.transformer.wte.weight.numel()
            exclude_position_embeddings = True
        if exclude_position_embeddings:
            n -= self.transformer.wpe.weight.numel()
        return n

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (HF's name; NEFTune adds its noise to this module's output)."""
        return self.transformer.wte

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Recompute each block's activations in the backward pass instead of keeping them (HF's method name).

        Saves the per-block activations (about ``12 * n_embd * seq`` values per token and layer under autocast)
        for one extra forward of each block: ~30% more compute. Only while training with gradients; the
        keyword arguments go to ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False`` by default: the
        non-reentrant form works with autocast, inputs without grad and ``torch.compile``).
        """
        self.gradient_checkpointing = True
        self._checkpoint_kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}

    def gradient_checkpointing_disable(self) -> None:
        """Turn activation checkpointing off again (HF's name)."""
        self.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether blocks recompute their activations in backward (HF's name)."""
        return self.gradient_checkpointing

    def estimate_flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token, for MFU: ``6N + 12 * n_layer * n_embd * seq_len``.

        N excludes the position table; the attention term (PaLM paper, appendix B) counts the full
        seq_len x seq_len score matrix, as nanoGPT does, though a causal kernel skips about half of it.
        ``seq_len`` defaults to ``block_size``.
        """
        cfg = self.config
        t = cfg.block_size if seq_len is None else seq_len
        n = self.num_parameters(exclude_position_embeddings=True)
        return 6 * n + 12 * cfg.n_layer * cfg.n_embd * t

    def _hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, seq), got {tuple(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.is_complex():
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        B, T = input_ids.shape
        bs = self.config.block_size
        if bs < T:
            raise ValueError(
                f"sequence length {T} exceeds the model's block_size {bs}; use --seq-len <= {bs} or a larger model"
            )
        # nn.Embedding takes int32/int64 only; uint8 ids straight from the byte corpus are widened losslessly
        if input_ids.dtype not in (torch.int64, torch.int32):
            input_ids = input_ids.long()
        mask = None if attention_mask is None else self._attention_bias(attention_mask, B, T)
        pos = torch.arange(T, device=input_ids.device)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(pos))
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            if checkpointing:
                x = torch.utils.checkpoint.checkpoint(block, x, mask, **self._checkpoint_kwargs)
            else:
                x = block(x, mask)
        return self.transformer.ln_f(x)

    @staticmethod
    def _attention_bias(attention_mask: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """Boolean (B, 1, T, T) mask: causal AND the key is not padding. Built on device, no host sync."""
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(
                f"attention_mask must have the shape of input_ids {(B, T)}, got {tuple(attention_mask.shape)}"
            )
        device = attention_mask.device
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        keys = attention_mask.bool()[:, None, None, :]
        # every query may always see itself: a query row with no visible key (a left-padding position)
        # would otherwise softmax over nothing and turn into NaN, which then poisons the gradients
        eye = torch.eye(T, dtype=torch.bool, device=device)
        return causal & (keys | eye)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Logits for every position and, with ``labels``, the mean next-token cross entropy.

        ``labels`` has the shape of ``input_ids`` and is shifted here (position t predicts label t + 1), so
        ``labels=input_ids`` is the usual call; label -100 is ignored (a batch whose every label is -100 has a
        NaN loss, 0/0, as in PyTorch). Padding is not masked out of the loss automatically: set those labels
        to -100. ``attention_mask`` (1 = token, 0 = padding) keeps queries from attending to padded keys;
        positions are still 0..T-1. Without a mask the causal flash path is used. Token ids are not range
        checked (that would sync): an id >= vocab_size is an index error on CPU, a device assert on CUDA.
        No host sync; the loss is an fp32 tensor even under fp16/bf16 autocast. With ``loss_chunk_size`` set, in
        training mode with labels, the loss is computed chunk by chunk and the logits are None.
        """
        h = self._hidden_states(input_ids, attention_mask)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}"
            )
        if labels is not None and self.config.loss_chunk_size and self.training:
            return CausalLMOutput(loss=self._chunked_loss(h, labels), logits=None)
        logits = self._logits(h)
        loss = None
        if labels is not None:
            # fp32 cross entropy: log-softmax in fp16 underflows the small probabilities (and its
            # gradient), so the loss a GradScaler scales must be fp32 whatever autocast chose for matmuls
            shift_logits = logits[:, :-1, :].float()
            shift_labels = labels[:, 1:].long()
            loss = F.cross_entropy(
                shift_logits.reshape(-1, shift_logits.size(-1)),
                shift_labels.reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
            if self.config.z_loss:
                loss = loss + self.config.z_loss * _z_loss(shift_logits, shift_labels)
        return CausalLMOutput(loss=loss, logits=logits)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's scores for the real words (a padded vocabulary's extra rows cut off: a view)."""
        logits = self.lm_head(h)
        return logits if self.config.vocab_multiple == 1 else logits[..., : self.config.vocab_size]

    def _chunked_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The shifted next-token loss through chunked_loss.py: the head's weight used directly (its module's
        forward, and hooks on it, do not run)."""
        hidden = h[:, :-1, :].reshape(-1, h.size(-1))
        return linear_cross_entropy(
            hidden,
            self.lm_head.weight,
            labels[:, 1:].reshape(-1).long(),
            chunk_size=self.config.loss_chunk_size,
            vocab_size=self.config.vocab_size,
            ignore_index=IGNORE_INDEX,
        )

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (batch, seq) and return (batch, seq + new).

        ``temperature=0`` picks the most likely token (greedy); ``top_k`` keeps the k likeliest; pass a
        ``generator`` (on the model's device) for reproducible samples. The context is cropped to the last
        ``block_size`` tokens. Runs in eval mode (restored after) and without a KV cache: each new token
        re-reads the context, fine for the small models this is for.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = idx[:, -self.config.block_size :]
                # only the last position is needed: skip the lm_head matmul for the others
                h = self._hidden_states(context, None)[:, -1, :]
                logits = self._logits(h).float()
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, num_samples=1, generator=generator)
                idx = torch.cat((idx, next_id.to(idx.dtype)), dim=1)
        finally:
            self.train(was_training)
        return idx


def _z_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared log-partition over the positions that have a label (fp32 logits in, no host sync)."""
    z = torch.logsumexp(logits, dim=-1)
    keep = (labels != IGNORE_INDEX).to(z.dtype)
    return (z.square() * keep).sum() / keep.sum()
