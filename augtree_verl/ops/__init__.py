"""Attention kernels with log-sum-exp and the exact merge of partial states: the bottom layer.

``ops.attention`` (query blocks against key/value blocks, returning lse; one backend per file:
``cpu_flash``, ``torch_flash``, ``flash_attn``; packed blocks described by ``ops.segments``) and
``ops.merge`` (the online-softmax merge) import nothing else of ours; ``replay``, ``cp`` and
``planner.calibrate`` build on them.
"""
