"""How a sequence's tokens are sharded over the ranks of a ring: the load-balanced zigzag split.

A sequence of L tokens is cut into 2m near-equal contiguous chunks (the first L mod 2m chunks one token
longer); ring member r owns chunks r and 2m-1-r, so every member gets one early (cheap under the causal
mask) and one late (expensive) chunk: ring-flash-attn's and Megatron's "zigzag" split. With m = 1 the
single member owns the whole sequence as one chunk. Short sequences leave some chunks, and possibly
whole members, empty; every consumer handles that.

Causality between chunks: a query of chunk a sees all of chunk b < a, the causal diagonal of chunk a,
nothing of chunk b > a. So a causal ring only ever computes full blocks and square diagonal blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Chunk:
    index: int  # chunk id in sequence order (the causal order)
    start: int  # first global position
    local_start: int  # offset of its first token in the member's local tensor
    length: int

    @property
    def local(self) -> slice:
        return slice(self.local_start, self.local_start + self.length)


@dataclass(frozen=True)
class ZigzagLayout:
    length: int  # L, tokens in the sequence
    parts: int  # m, ring members

    def __post_init__(self):
        if self.length < 0:
            raise ValueError(f"ZigzagLayout.length must be >= 0, got {self.length}")
        if self.parts < 1:
            raise ValueError(f"ZigzagLayout.parts must be >= 1, got {self.parts}")

    @cached_property
    def _chunk_bounds(self) -> list[tuple[int, int]]:
        n = 1 if self.parts == 1 else 2 * self.parts
        base, extra = divmod(self.length, n)
        bounds, start = [], 0
        for c in range(n):
            size = base + (1 if c < extra else 0)
            bounds.append((start, start + size))
            start += size
        return bounds

    def chunks(self, member: int) -> list[Chunk]:
        """The non-empty chunks member ``member`` owns, in its local order (increasing positions)."""
        if not 0 <= member < self.parts:
            raise ValueError(f"member {member} outside a ring of {self.parts}")
        ids = [0] if self.parts == 1 else [member, 2 * self.parts - 1 - member]
        out, offset = [], 0
        for c in ids:
            start, end = self._chunk_bounds[c]
            if end > start:
                out.append(Chunk(c, start, offset, end - start))
                offset += end - start
        return out

    def size(self, member: int) -> int:
        return sum(c.length for c in self.chunks(member))

    def sizes(self) -> list[int]:
        return [self.size(r) for r in range(self.parts)]

    def positions(self, member: int, offset: int = 0, device=None) -> torch.Tensor:
        """LongTensor [size(member)]: global positions (plus ``offset``) of the member's tokens, local order."""
        parts = [torch.arange(c.start, c.start + c.length, device=device) for c in self.chunks(member)]
        pos = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
        return pos + offset

    def owner(self, position: int) -> tuple[int, int]:
        """(member, local index) of global position ``position``."""
        if not 0 <= position < self.length:
            raise ValueError(f"position {position} outside a sequence of {self.length}")
        for member in range(self.parts):
            for c in self.chunks(member):
                if c.start <= position < c.start + c.length:
                    return member, c.local_start + position - c.start
        raise AssertionError("unreachable: chunks cover the sequence")


def lane_members(degree: int, lanes: int, lane: int) -> tuple[int, ...]:
    """CP ranks of lane ``lane`` when ``degree`` ranks form ``lanes`` lanes: the contiguous block
    [lane * d // s, (lane + 1) * d // s); with s dividing d, ranks lane*d/s .. (lane+1)*d/s - 1."""
    if not 1 <= lanes <= degree:
        raise ValueError(f"lanes must be in [1, degree={degree}], got {lanes}")
    if not 0 <= lane < lanes:
        raise ValueError(f"lane {lane} outside {lanes} lanes")
    return tuple(range(lane * degree // lanes, (lane + 1) * degree // lanes))
