"""``TransformerWithSharedParams`` from PyTorch's ``torch/testing/_internal/common_fsdp.py``."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.models.base import ReferenceModel, quiet_construct

__all__ = ["TransformerWithSharedParams"]

D_VOCAB = 23
D_MODEL = 16
BATCH = 2
SRC_LEN = 6
TGT_LEN = 4


class TransformerWithSharedParams(ReferenceModel):
    """A small encoder-decoder ``nn.Transformer`` whose output projection shares
    its weight with the token embedding.

    Mirrors ``TransformerWithSharedParams`` of
    ``torch/testing/_internal/common_fsdp.py`` with ``deterministic=True``,
    ``add_bn=True`` and ``FSDPInitMode.RECURSIVE``.

    * Modules: ``embed_tokens = Embedding(23, 16)``;
      ``transformer = nn.Transformer(d_model=16, nhead=8, num_encoder_layers=2,
      num_decoder_layers=2, dim_feedforward=8, dropout=0.1)``;
      ``output_proj = Linear(16, 23)`` whose ``weight`` *is*
      ``embed_tokens.weight`` (one ``Parameter``, shape ``(23, 16)``);
      ``bn = BatchNorm1d(2)`` on the target embeddings. Buffers
      ``vocab_bias = ones(16)`` and ``long_buffer = zeros(16, dtype=long)``
      (plus BatchNorm's running statistics). 68 distinct parameters, all float32.
    * The model is put in ``eval()`` mode after construction, as PyTorch's
      deterministic mode does: dropout is off and BatchNorm uses its running
      statistics, so forward is a deterministic function of parameters and
      input. Do not call ``train()`` on it if determinism matters. Backward
      works in eval mode: with autograd enabled ``nn.TransformerEncoderLayer``
      does not take its inference fast path, and ``nn.Transformer``'s encoder
      never uses nested tensors (``batch_first=False``), so every parameter
      receives a gradient.
    * FSDP units: 5: the root (embedding/projection, encoder and decoder final
      norms, BatchNorm) with ``auto_wrap_policy=ModuleWrapPolicy({TransformerEncoderLayer,
      TransformerDecoderLayer})`` wrapping each of the 2 encoder and 2 decoder
      layers. If ``fsdp_kwargs`` carries a ``mixed_precision``, FSDP also
      wraps the BatchNorm on its own (``MixedPrecision._module_classes_to_ignore``),
      giving 6. A caller-supplied ``auto_wrap_policy`` replaces the default
      (as in PyTorch).
    * Input: ``(src_ids, tgt_ids)``, int64, sequence-first: ``src_ids`` shape
      ``(6, 2)`` = ``(arange(12) + rank) % 23``, ``tgt_ids`` shape ``(4, 2)`` =
      ``(arange(8) * (rank + 1)) % 23``. Output ``(4, 2, 23)`` logits. Loss:
      ``cross_entropy(output.view(-1, 23), tgt_ids.view(-1), reduction="sum")``.

    Deviations from PyTorch: (1) ``vocab_bias`` and the BatchNorm output are
    cast to the embedding dtype (``type_as``; no-ops in full precision, so the
    float32 numerics are PyTorch's) because under
    ``MixedPrecision(param_dtype=...)`` FSDP keeps buffers (default
    ``buffer_dtype``) and the separately wrapped BatchNorm in float32, and the
    encoder/decoder layers would otherwise get float32 activations with
    low-precision weights and fail. (2) PyTorch's ``get_input`` returns
    ``arange`` ids that are the same on every rank; here they depend on the
    rank so that a hook that does not communicate is caught. Rank 0 gets
    exactly PyTorch's input.
    Ranks ``r`` and ``r + 23`` get the same input (ids are taken modulo the
    vocabulary size), which matters only for groups larger than 23.
    """

    name = "transformer_shared"
    fsdp_units = 5

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(D_VOCAB, D_MODEL)
        # batch_first=False (as in PyTorch's model) makes nn.TransformerEncoder
        # warn at construction that it will not use nested tensors; that is
        # the intended behaviour here, so the warning is silenced.
        self.transformer = quiet_construct(
            lambda: nn.Transformer(
                d_model=D_MODEL,
                num_encoder_layers=2,
                num_decoder_layers=2,
                dim_feedforward=8,
                dropout=0.1,
            ),
            "enable_nested_tensor is True",
        )
        self.output_proj = nn.Linear(D_MODEL, D_VOCAB)
        self.output_proj.weight = self.embed_tokens.weight  # shared parameter
        self.register_buffer("vocab_bias", self.embed_tokens.weight.new_ones((D_MODEL,)))
        self.register_buffer(
            "long_buffer", torch.zeros_like(self.vocab_bias, dtype=torch.long)
        )
        self.bs = BATCH
        self.bn = nn.BatchNorm1d(BATCH)

    @classmethod
    def _construct(cls, world_size: int) -> "TransformerWithSharedParams":
        model = cls()
        model.eval()
        return model

    @classmethod
    def _root_fsdp_kwargs(cls, fsdp_kwargs: Dict[str, Any]) -> Dict[str, Any]:
        if "auto_wrap_policy" in fsdp_kwargs:
            return {"auto_wrap_policy": fsdp_kwargs.pop("auto_wrap_policy")}
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return {
            "auto_wrap_policy": ModuleWrapPolicy(
                {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
            )
        }

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        src = self.embed_tokens(src_ids)
        # ``type_as`` on the buffer keeps ``src`` in the parameter dtype under
        # MixedPrecision(param_dtype=...) with float32 buffers (a no-op otherwise).
        src = src + self.vocab_bias.type_as(src) + self.long_buffer.type_as(src)
        tgt = self.embed_tokens(tgt_ids)
        # FSDP runs BatchNorm as its own full-precision unit when a
        # MixedPrecision is given; cast back so the decoder sees one dtype.
        # A no-op (same tensor) without mixed precision.
        tgt = self.bn(tgt).type_as(tgt)
        return self.output_proj(self.transformer(src, tgt))

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        src = ((torch.arange(SRC_LEN * BATCH) + rank) % D_VOCAB).view(SRC_LEN, BATCH)
        tgt = ((torch.arange(TGT_LEN * BATCH) * (rank + 1)) % D_VOCAB).view(TGT_LEN, BATCH)
        return (src.to(device), tgt.to(device))

    @classmethod
    def loss(cls, inputs: tuple, output: Any) -> torch.Tensor:
        _, tgt = inputs
        return F.cross_entropy(
            output.view(-1, output.size(-1)), tgt.view(-1), reduction="sum"
        )
