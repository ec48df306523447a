"""Context-parallel primitives (docs/design.md §3): RingCP, TreeMoveKV and MoveQ as exact autograd primitives,
their communication, layouts and byte formulas, the per-tree CP schedule (``schedule``) and the CP group
facts (``mesh``). The engine that runs them is ``augtree_verl.replay``; the attention kernels and the merge
they build on live in ``augtree_verl.ops``. Nothing here imports ``replay``.
"""
