"""Grouped replay: prompt prefilled once per tree, responses replayed against its K/V, one delayed prompt backward.

Build a ``StepPlan`` of the step's trees (``groups.Tree.of_tokens``), then ``replay(model, step_plan, loss, options)``
(``ReplayOptions``: how to run it).
"""

from augtree_verl.groups import Tree
from augtree_verl.replay.offload import Offload
from augtree_verl.replay.options import ReplayOptions
from augtree_verl.replay.prompt_kv import held_prompt_tensors
from augtree_verl.replay.run import per_response, replay
from augtree_verl.replay.stats import ReplayStats
from augtree_verl.replay.step_plan import StepPlan

__all__ = [
    "Offload",
    "ReplayOptions",
    "ReplayStats",
    "StepPlan",
    "Tree",
    "held_prompt_tensors",
    "per_response",
    "replay",
]
