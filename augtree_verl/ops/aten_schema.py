"""Calls of torch's private ATen ops, bound by argument name to the installed torch's op schema.

The attention backends call four private ops (``_flash_attention_forward/_backward`` on CUDA,
``_scaled_dot_product_flash_attention_for_cpu`` and its backward on CPU), whose argument lists change between
torch releases (2.13 added ``block_table`` and ``num_splits`` to ``_flash_attention_forward``; 2.11 has
neither). A call site names every argument it gives; ``AtenCall`` reads the op's schema once (schemas are
readable without a GPU) and passes each argument where the schema has it: positionally in schema order,
keyword-only arguments by keyword, schema arguments with a default that the call does not give left to their
default. What cannot be bound is refused at the first call by a ``ValueError`` naming the op, the argument and
the torch version: an argument the call gives that the schema does not have, or a schema argument without a
default that the call does not give. The binding adapts by schema, never by version string.
"""

from __future__ import annotations

import torch


class AtenCall:
    """``AtenCall("_flash_attention_forward")(query=q, key=k, ...)`` -> the op's result."""

    def __init__(self, name: str, overload: str = "default"):
        self.name, self.overload = name, overload
        self._op = None
        self._bound: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # (positional, keyword) names
        self._names: frozenset[str] = frozenset()

    def op(self) -> torch._ops.OpOverload:
        if self._op is None:
            packet = getattr(torch.ops.aten, self.name, None)
            overload = getattr(packet, self.overload, None) if packet is not None else None
            if overload is None:
                raise ValueError(
                    f"torch {torch.__version__} has no ATen op aten::{self.name}.{self.overload}, "
                    f"which augtree_verl's attention calls: install a torch release in the range "
                    f"pyproject.toml admits"
                )
            self._op = overload
        return self._op

    def bind(self, names) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Place the argument ``names`` by the installed schema: (positional names, keyword names)."""
        schema = self.op()._schema
        given = set(names)
        unknown = given - {a.name for a in schema.arguments}
        if unknown:
            raise ValueError(
                f"aten::{self.name} of torch {torch.__version__} has no argument "
                f"{', '.join(sorted(unknown))} (its schema: {schema}); augtree_verl cannot call it"
            )
        positional, keyword, gap = [], [], False
        for arg in schema.arguments:
            if arg.name not in given:
                if not arg.has_default_value():
                    raise ValueError(
                        f"aten::{self.name} of torch {torch.__version__} requires argument "
                        f"{arg.name!r} ({arg.type}), which augtree_verl's call does not give "
                        f"(its schema: {schema})"
                    )
                gap = True
            elif arg.kwarg_only or gap:
                keyword.append(arg.name)
            else:
                positional.append(arg.name)
        return tuple(positional), tuple(keyword)

    def __call__(self, /, **arguments):
        if self._bound is None:
            self._bound, self._names = self.bind(arguments), frozenset(arguments)
        positional, keyword = self._bound
        if arguments.keys() != self._names:
            raise ValueError(
                f"aten::{self.name} was first called with arguments {sorted(self._names)}, now with "
                f"{sorted(arguments)}: one AtenCall serves one call site"
            )
        return self._op(*(arguments[n] for n in positional), **{n: arguments[n] for n in keyword})
