"""The lm_head's forms: the verifier's (``EngineConfig.head``) and the draft's (``SpecConfig.draft_head``).

A verify pass reads the whole head once for 1-16 rows of hidden states, so on the CPU each form is chosen
for its bytes and for a product that costs what its bytes cost. The verifier's head decides every token,
so its precision is the output's: ``int16`` (the default) keeps each weight to about 15 significant bits
in half fp32's bytes; ``bf16`` halves them too but rounds weights and logits to 8 bits; ``fp32`` is the
weight as stored. The draft only ranks its candidates, so its head may be coarser (``Int8Head``).
"""

from __future__ import annotations

import warnings

import torch
from llvmlite import binding as llvm
from torch import Tensor

from splitspec.config import VERIFIER_HEADS
from splitspec.kernels import head as head_kernel


def _int8_sums_saturate() -> bool:
    """Whether fbgemm's int8 product adds pairs of u8 × s8 products in int16 (vpmaddubsw) on this host, as
    it does without AVX-512 VNNI: 8-bit activations then saturate those sums and a logit can be off by a
    tenth of the largest. 7-bit activations (``reduce_range``) keep every pair inside int16."""
    return "+avx512vnni" not in llvm.get_host_cpu_features().flatten()


class Int8Head:
    """The draft's copy of the lm_head in int8 with one scale per vocabulary row, multiplied by torch's
    quantized dynamic linear (int8 weights, activations quantized per call, to 7 bits where the host's
    int8 sums would saturate). The draft only ranks its candidates and the verifier's head decides every
    token, so this copy's precision never changes the output; it reads a quarter of fp32's bytes."""

    _REDUCE_RANGE = _int8_sums_saturate()

    def __init__(self, weight: Tensor) -> None:
        scale = (weight.abs().amax(1).clamp(min=1e-30) / 127).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch marks its qint8 tensors deprecated; torch is pinned here
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            q = torch.quantize_per_channel(weight.float().cpu().contiguous(), scale, zeros, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(q, None)
        self.nbytes = weight.numel() + 8 * weight.shape[0]

    def __call__(self, h: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic(h.contiguous(), self._packed, reduce_range=self._REDUCE_RANGE)


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
