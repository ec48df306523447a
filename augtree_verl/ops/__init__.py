"""Attention kernels with log-sum-exp and the exact merge of partial states: the bottom layer.

``ops.attention`` (one query block against one key/value block, returning lse) and ``ops.merge`` (the
online-softmax merge) import nothing else of ours; ``replay``, ``cp`` and ``planner.calibrate`` build on them.
"""
