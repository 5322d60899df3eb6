"""The lm_head's forms: the verifier's (``EngineConfig.head``) and the draft's (``SpecConfig.draft_head``).

A verify pass reads the whole head once for 1-16 rows of hidden states, so on the CPU each form is chosen
for its bytes and for a product that costs what its bytes cost. The verifier's head decides every token,
so its precision is the output's: ``int16`` (the default) keeps each weight to about 15 significant bits
in half fp32's bytes; ``bf16`` halves them too but rounds weights and logits to 8 bits; ``fp32`` is the
weight as stored. The draft only ranks its candidates, so its head may be coarser (``Int8Head``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from splitspec.config import VERIFIER_HEADS
from splitspec.kernels import head as head_kernel
from splitspec.kernels.residual import ResidualMatrix
from splitspec.quantize import packing
from splitspec.quantize.gptq import to_scale_grid


class Int8Head:
    """The draft's copy of the lm_head: int8 codes under one scale per 128 columns of a row (on the
    residual's scale grid), packed and multiplied as the 8-bit residual is (``kernels.residual``, the
    hidden states rounded to int16). It reads a quarter of fp32's bytes at the rate the CPU actors stream
    the residual. The draft only ranks its candidates and the verifier's head decides every token, so
    this copy's precision never changes the output."""

    def __init__(self, weight: Tensor) -> None:
        w = weight.detach().float().cpu().numpy()
        rows, cols = w.shape
        groups = -(-cols // packing.GROUP)
        padded = np.zeros((rows, groups * packing.GROUP), np.float32)
        padded[:, :cols] = np.abs(w)
        scales = to_scale_grid(padded.reshape(rows, groups, packing.GROUP).max(axis=2) / 127)
        codes = np.clip(np.rint(w / np.repeat(scales, packing.GROUP, axis=1)[:, :cols]), -127, 127).astype(np.int8)
        self._matrix = ResidualMatrix(packing.pack_residual(codes, scales, 8), 8, rows, cols)
        self.nbytes = self._matrix.nbytes

    def __call__(self, h: Tensor) -> Tensor:
        x = h.detach().float().contiguous().numpy()
        out = np.empty((x.shape[0], self._matrix.rows), np.float32)
        self._matrix.matmul(x, out, "int16")
        return torch.from_numpy(out)


class TiledHead:
    """The verifier's fp32 lm_head on the CPU, stored as tiles of ``BLOCK`` vocabulary columns, [blocks,
    hidden, BLOCK], each tile contiguous, and multiplied by one batched product over the tiles.

    A pass has 1-16 rows of hidden states against a matrix read from memory once, so the product should
    cost what its bytes cost whatever the rows. One sgemm on [hidden, vocab] does not: from two rows on,
    BLAS walks that matrix in panels that span its vocabulary-wide rows and costs well over its bytes, and
    the more rows the worse. A tile fits in the core's L2 while every row uses it. The vocabulary past the
    last whole tile is one more product."""

    BLOCK = 256

    def __init__(self, weight: Tensor) -> None:
        vocab, hidden = weight.shape
        whole = vocab - vocab % self.BLOCK
        self._tiles = weight[:whole].reshape(-1, self.BLOCK, hidden).transpose(1, 2).contiguous()
        self._tail = weight[whole:].T.contiguous() if whole < vocab else None  # [hidden, vocab - whole]
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, h: Tensor) -> Tensor:
        n = h.shape[0]
        out = torch.bmm(h.expand(self._tiles.shape[0], n, h.shape[1]), self._tiles).permute(1, 0, 2).reshape(n, -1)
        return out if self._tail is None else torch.cat((out, h @ self._tail), dim=1)


class Bf16Head:
    """The verifier's lm_head stored in bf16 (``EngineConfig.head = "bf16"``): half the bytes of fp32 per
    pass. On the CPU the weight is packed once for oneDNN (bf16 products with fp32 accumulation, the
    logits rounded to bf16 on the way out); an unpacked bf16 matmul there costs about what fp32 does. On
    CUDA, a plain bf16 matmul. Logits come back fp32 either way."""

    def __init__(self, weight: Tensor) -> None:
        self._weight = weight.to(torch.bfloat16).contiguous()
        self._packed = None
        if weight.device.type == "cpu":
            if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                raise ValueError('EngineConfig.head = "bf16" needs a CPU with bf16 support in oneDNN; use "fp32"')
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self._weight, 1)
        self.nbytes = weight.numel() * 2

    def __call__(self, h: Tensor) -> Tensor:
        x = h.to(torch.bfloat16)
        if self._packed is None:
            return (x @ self._weight.T).float()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [None], "").float()


class Int16Head:
    """The verifier's lm_head as int16 codes under one fp32 scale per vocabulary row (``kernels.head``),
    multiplied with fp32 hidden states into fp32 logits: half the bytes of fp32 per pass, and a weight error
    of at most half a step of its row's largest magnitude / 32767. On CUDA the same codes are dequantized
    once to fp32 and multiplied by a plain matmul, so the logits do not depend on the device (no memory is
    saved there)."""

    def __init__(self, weight: Tensor) -> None:
        codes, scale = head_kernel.quantize_rows(weight.detach().float().cpu().numpy())
        self.nbytes = codes.nbytes + scale.nbytes
        self._codes, self._scale, self._weight = codes, scale, None
        if weight.device.type != "cpu":  # the device's copy only: the host's codes are not kept
            self._weight = (torch.from_numpy(codes).float() * torch.from_numpy(scale)[:, None]).to(weight.device)
            self._codes = self._scale = None

    def __call__(self, h: Tensor, rows: int | None = None) -> Tensor:
        """Logits [n, vocab] of h [n, hidden], or of the first ``rows`` vocabulary rows only (the engine's part
        when the CPU actors multiply the rest, ``EngineConfig.head_share``)."""
        if self._weight is not None:
            return h @ self._weight[:rows].T
        codes, scale = self._codes[:rows], self._scale[:rows]
        return torch.from_numpy(head_kernel.product(codes, scale, h.detach().float().numpy()))


Head = Int16Head | Bf16Head | TiledHead | Int8Head


def verifier_head(weight: Tensor, kind: str) -> Head | None:
    """The verifier's head of ``kind`` (``VERIFIER_HEADS``) for the stored [vocab, hidden] fp32 weight, or
    None where the plain ``h @ weight.T`` is the product (fp32 off the CPU)."""
    if kind not in VERIFIER_HEADS:
        raise ValueError(f"head must be one of {', '.join(VERIFIER_HEADS)}, got {kind!r}")
    if kind == "int16":
        return Int16Head(weight)
    if kind == "bf16":
        return Bf16Head(weight)
    return TiledHead(weight) if weight.device.type == "cpu" else None
