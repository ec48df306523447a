"""Grouped replay: prompt prefilled once per tree, responses replayed against its K/V, one delayed prompt backward."""

from augtree_verl.replay.engine import replay
from augtree_verl.replay.offload import Offload
from augtree_verl.replay.prompt_kv import held_prompt_tensors
from augtree_verl.replay.stats import ReplayStats
from augtree_verl.replay.tree import ReplayTree

__all__ = ["Offload", "ReplayStats", "ReplayTree", "held_prompt_tensors", "replay"]
