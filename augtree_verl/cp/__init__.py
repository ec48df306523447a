"""Context-parallel replay (DESIGN.md §2, issue 3): RingCP, TreeMoveKV and MoveQ as exact autograd primitives."""
