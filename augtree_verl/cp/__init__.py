"""Context-parallel replay (docs/design.md §3): RingCP, TreeMoveKV and MoveQ as exact autograd primitives.

``augtree_verl.cp.engine.replay_cp`` runs the grouped replay over a CP process group; ``augtree_verl.replay``
dispatches to it when a plan has degree > 1. The attention kernels and the merge they build on live in
``augtree_verl.ops``.
"""
