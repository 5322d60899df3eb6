"""A sequence's recurrent state in Qwen 3.5's linear-attention layers, kept beside its K/V (``KVCache.delta``).

An attention layer can roll back by forgetting slots; a recurrence cannot. So the state is held at a *base*
slot, and the slots written after it stay *pending*: each keeps what the closed form of the gated delta rule
needs to be read by its descendants or folded in later (``delta_rule``: k, u, G, and the conv's input x).
A check's draft and verify passes write pending entries, which a rollback (``truncate``) drops like K/V;
``keep`` folds the accepted path into the state, which then sits at the new end. A pass without a mask of
its own (a prompt's chunk, a chain appended) is final as it is written: each layer folds its rows into a
second copy of the state (``advance``), which becomes the state once every layer has run (``swap``, from
``KVCache.commit``), so a prompt's chunk leaves no entries behind and a pass that fails changes nothing.
The state cannot go back before its base: a rollback past it is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from splitspec.gpu_actor.delta_rule import conv_window, fold
from splitspec.models.spec import DeltaNet


class DeltaState:
    """``layers`` linear-attention layers' states [layers, n_v, k_dim, v_dim] and conv windows [layers, conv - 1,
    conv_dim] at slot ``base``, and the pending entries of slots ``[base, base + capacity)``, grown on demand."""

    def __init__(self, layers: int, net: DeltaNet, device: str | torch.device, capacity: int = 16) -> None:
        self.net, self.device = net, torch.device(device)
        self.state = torch.zeros(layers, net.n_v, net.k_dim, net.v_dim, device=device)
        self.window = torch.zeros(layers, net.conv - 1, net.conv_dim, device=device)
        self._next = (torch.zeros_like(self.state), torch.zeros_like(self.window))  # a final pass's (``advance``)
        self.base = 0
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

    def entries(self, layer: int, stop: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``layer``'s pending (k, u, G, x) of slots ``[base, stop)``: views to read the earlier ones from and
        write a pass's own rows into; the storage grows (doubling) to hold them."""
        need = stop - self.base
        if need > self.k.shape[1]:
            old = (self.k, self.u, self.big_g, self.x)
            self._entries(self.k.shape[0], max(need, 2 * self.k.shape[1]))
            for new, t in zip((self.k, self.u, self.big_g, self.x), old, strict=True):
                new[:, : t.shape[1]] = t
        return self.k[layer, :need], self.u[layer, :need], self.big_g[layer, :need], self.x[layer, :need]

    def advance(self, layer: int, k: Tensor, u: Tensor, big_g: Tensor, x: Tensor) -> None:
        """``layer``'s state after a final pass: its pending entries and then its rows (k, u, G, x), one chain
        from the base, folded into the second copy that ``swap`` makes the state."""
        state, window = self._next
        fold(self.state[layer], k, u, big_g, out=state[layer])
        window[layer] = conv_window(self.window[layer], x)

    def swap(self, stop: int) -> None:
        """After a final pass that every layer ``advance``d: its state is the state, at ``stop``."""
        (self.state, self.window), self._next = self._next, (self.state, self.window)
        self.base = stop

    def keep(self, start: int, slots: Sequence[int]) -> None:
        """After a check: the pending slots before ``start`` and then ``slots`` (the accepted path) folded in;
        the state then sits at ``start + len(slots)``."""
        idx = torch.as_tensor([*range(start - self.base), *(s - self.base for s in slots)], device=self.device)
        for layer in range(self.state.shape[0]):
            k, u, big_g, x = (t[layer, idx] for t in (self.k, self.u, self.big_g, self.x))
            fold(self.state[layer], k, u, big_g, out=self.state[layer])
            self.window[layer] = conv_window(self.window[layer], x)
        self.base = start + len(slots)

    def truncate(self, length: int) -> None:
        if length < self.base:
            raise ValueError(
                f"a linear-attention state folded up to slot {self.base} cannot roll back to {length}: "
                "roll back only the slots written since the last check"
            )

    def load(self, other: DeltaState, n: int) -> None:
        """Start from ``other``'s state, which must sit at slot ``n`` (``KVCache.resumable``)."""
        if other.base != n:
            raise ValueError(f"a linear-attention state at slot {other.base} cannot resume at {n}")
        self.state.copy_(other.state)
        self.window.copy_(other.window)
        self.base = n
