"""A sequence's recurrent state in Qwen 3.5's linear-attention layers, kept beside its K/V (``KVCache.delta``).

An attention layer can roll back by forgetting slots; a recurrence cannot. So the state is held at a *base*
slot, and the slots written after it stay *pending*: each keeps what the closed form of the gated delta rule
needs to be read by its descendants or folded in later (``delta_rule``: k, u, G, and the conv's input x).
A check's draft and verify passes write pending entries, which a rollback (``truncate``) drops like K/V;
``keep`` compacts the accepted path's entries behind the verified ones, as it does K/V, and folds the
verified chain into the state once it is ``FOLD_AFTER`` slots long: a fold reads and writes the whole state
(n_v × k_dim × v_dim per layer) twice, a pending entry costs each later pass a row of k and u, so folding
every few checks rather than after each moves a fraction of the bytes. A pass without a mask of
its own (a prompt's chunk, a chain appended) is final as it is written: each layer puts its state after
the pass into a second copy (``advance``), which becomes the state once every layer has run (``swap``, from
``KVCache.commit``), so a prompt's chunk leaves no entries behind and a pass that fails changes nothing.
The state cannot go back before its base: a rollback past it is refused. A sequence can resume from any
slot of the verified chain (``resumable``), its entries copied with the state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from splitspec.gpu_actor.delta_rule import conv_window, fold, subnormals_flushed
from splitspec.models.spec import DeltaNet

FOLD_AFTER = 16  # verified slots kept pending before ``keep`` folds them (the per-token traffic's minimum is near)


class DeltaState:
    """``layers`` linear-attention layers' states [layers, n_v, k_dim, v_dim] and conv windows [layers, conv - 1,
    conv_dim] at slot ``base``, and the pending entries of slots ``[base, base + capacity)``, grown on demand;
    those of ``[base, chain)`` are verified, one chain."""

    def __init__(self, layers: int, net: DeltaNet, device: str | torch.device, capacity: int = 16) -> None:
        self.net, self.device = net, torch.device(device)
        self.state = torch.zeros(layers, net.n_v, net.k_dim, net.v_dim, device=device)
        self.window = torch.zeros(layers, net.conv - 1, net.conv_dim, device=device)
        self._next = (torch.zeros_like(self.state), torch.zeros_like(self.window))  # a final pass's (``advance``)
        self.base = self.chain = 0
        self._entries(layers, capacity)

    def _entries(self, layers: int, capacity: int) -> None:
        net, device = self.net, self.device
        self.k = torch.zeros(layers, capacity, net.n_v, net.k_dim, device=device)
        self.u = torch.zeros(layers, capacity, net.n_v, net.v_dim, device=device)
        self.big_g = torch.zeros(layers, capacity, net.n_v, device=device)
        self.x = torch.zeros(layers, capacity, net.conv_dim, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.state, self.window, *self._next, self.k, self.u, self.big_g, self.x))

    @property
    def stored(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every layer's pending (k, u, G, x), [layers, capacity, ...] each."""
        return self.k, self.u, self.big_g, self.x

    @property
    def buffers(self) -> tuple[int, ...]:
        """The addresses of its tensors (``KVCache.buffers``): a recorded step reads and writes them."""
        return tuple(t.data_ptr() for t in (self.state, self.window, *self.stored))

    def hold(self, stop: int) -> None:
        """Room (doubling) for the pending entries of slots ``[base, stop)``: a recorded step is made for the
        storage it finds, so its caller grows it first."""
        need = stop - self.base
        if need > self.k.shape[1]:
            old = self.stored
            self._entries(self.k.shape[0], max(need, 2 * self.k.shape[1]))
            for new, t in zip(self.stored, old, strict=True):
                new[:, : t.shape[1]] = t

    def entries(self, layer: int, stop: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``layer``'s pending (k, u, G, x) of slots ``[base, stop)``: views to read the earlier ones from and
        write a pass's own rows into."""
        self.hold(stop)
        need = stop - self.base
        return self.k[layer, :need], self.u[layer, :need], self.big_g[layer, :need], self.x[layer, :need]

    def advance(self, layer: int, state: Tensor, window: Tensor) -> None:
        """``layer``'s state and conv window after a final pass, into the second copy that ``swap`` makes
        the state."""
        self._next[0][layer] = state
        self._next[1][layer] = window

    def swap(self, stop: int) -> None:
        """After a final pass that every layer ``advance``d: its state is the state, at ``stop``."""
        (self.state, self.window), self._next = self._next, (self.state, self.window)
        self.base = self.chain = stop

    def settle(self, stop: int) -> None:
        """The pending slots before ``stop``, a chain that no rollback will take back (a recorded pass without
        a mask of its own), folded into the state in place."""
        self._fold(stop - self.base)
        self.base = self.chain = stop

    def _fold(self, count: int) -> None:
        with subnormals_flushed(self.device.type == "cpu"):
            for layer in range(self.state.shape[0]):
                k, u, big_g, x = (t[layer, :count] for t in self.stored)
                fold(self.state[layer], k, u, big_g, out=self.state[layer])
                self.window[layer] = conv_window(self.window[layer], x)

    def keep(self, start: int, slots: Sequence[int]) -> None:
        """After a check: ``slots`` (the accepted path, increasing, from ``start``) moved to follow the verified
        slots before ``start``, which then run to ``start + len(slots)``; folded in from ``FOLD_AFTER`` on."""
        self.chain = start + len(slots)
        src = torch.as_tensor([s - self.base for s in slots], dtype=torch.long, device=self.device)
        for t in self.stored:
            t[:, start - self.base : self.chain - self.base] = t[:, src]
        if self.chain - self.base >= FOLD_AFTER:
            self._fold(self.chain - self.base)
            self.base = self.chain

    def truncate(self, length: int) -> None:
        if length < self.base:
            raise ValueError(
                f"a linear-attention state folded up to slot {self.base} cannot roll back to {length}: "
                "roll back only to slots after it"
            )
        self.chain = min(self.chain, length)

    def resumable(self, n: int) -> bool:
        """Whether the state at slot ``n`` is known: ``n`` on the verified chain from the base."""
        return self.base <= n <= self.chain

    def load(self, other: DeltaState, n: int) -> None:
        """Start from ``other``'s state at slot ``n`` (``resumable``): its state and its verified entries to ``n``."""
        if not other.resumable(n):
            raise ValueError(
                f"a linear-attention state verified over slots {other.base}..{other.chain} cannot resume at {n}"
            )
        self.state.copy_(other.state)
        self.window.copy_(other.window)
        self.base, self.chain = other.base, n
        self.hold(n)
        for mine, theirs in zip(self.stored, other.stored, strict=True):
            mine[:, : n - other.base] = theirs[:, : n - other.base]
