"""How long the engine's ``StepPlan.from_batch`` takes on a realistic batch (CPU; no model call).

    python benchmarks/step_plan_time.py [--groups 16] [--responses 8] [--repeats 7]

The batch: ``--groups`` prompts of 2k-4k tokens with ``--responses`` responses of 0.5k-2k tokens each (seeded
draws, the engine's ``find_trees`` of the batch's sequences); ``system``: the same with a batch-wide 1k-token
system prompt in front of every prompt (the whole batch one trie). Each tree carries a degree-2 plan with the
planner's estimates. Planned with no CP group and as rank 0 of a CP group of 2 (trees placed by
``assign_subgroups``), with the cost model the engine passes (``trie_cost``; here the default profile's): with
the system prompt the batch is one trie whose root the cost model puts context-parallel over the CP group
(``shared_root_plans``; the table's CP roots). The table reports the median wall and process CPU time of
``--repeats`` builds.

Measured on the 2-core dev machine under load (other tests running), 9 builds: groups / no CP
3.4 ms, groups / CP 2 3.7 ms, system / no CP 4.1 ms, system / CP 2 8.9 ms with its root context-parallel (the
cost model's comparison of the CP root with the chunks included). The planner service plans each group alone;
the step plan's trie decision is what a step adds on the GPUs' path, a few milliseconds. On CPU the copies to
the host are free; on a GPU each build also costs a host sync and a copy of every row's ids.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from augtree_verl.cp.mesh import CPMesh
from augtree_verl.groups import find_trees
from augtree_verl.plan import Plan
from augtree_verl.plan_field import plan_entries
from augtree_verl.planner.cost import cost_model
from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.replay.step_plan import StepPlan

SYSTEM_TOKENS = 1024


def batch(groups: int, responses: int, system: bool, seed: int = 0):
    """(trees, plan field entries) of one batch, as the engine finds them."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 150_000, (n,), generator=g)
    head = ids(SYSTEM_TOKENS) if system else ids(0)
    uids, prompt_lens, response_lens, sequences = [], [], [], []
    for k in range(groups):
        prompt = torch.cat([head, ids(int(torch.randint(2048, 4097, (1,), generator=g)))])
        for _ in range(responses):
            response = ids(int(torch.randint(512, 2049, (1,), generator=g)))
            uids.append(f"g{k}")
            prompt_lens.append(len(prompt))
            response_lens.append(len(response))
            sequences.append(torch.cat([prompt, response]))
    trees = find_trees(uids, prompt_lens, response_lens, sequences)
    plans = {t.tree_id: Plan(degree=2, est_time_s=0.6, est_single_s=1.0) for t in trees}
    return trees, plan_entries(find_trees(uids, prompt_lens, response_lens), plans, len(uids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    config = transformers.Qwen2Config()
    trie_cost = cost_model(ClusterProfile.default())  # the engine passes its run's calibrated cost model
    print(f"{'batch':>8} {'mesh':>6} {'row tokens':>11} {'median ms':>10} {'cpu ms':>8} {'CP roots':>8}")
    for system in (False, True):
        trees, entries = batch(args.groups, args.responses, system)
        tokens = sum(t.prompt_len * len(t.response_lens) + sum(t.response_lens) for t in trees)  # the rows'
        for name, mesh in (("none", None), ("cp2", CPMesh.for_planning((1, 2), 0))):
            times, cpu = [], []
            for _ in range(args.repeats):
                start, cpu_start = time.perf_counter(), time.process_time()
                step_plan = StepPlan.from_batch(trees, entries, mesh=mesh, model_config=config, trie_cost=trie_cost)
                cpu.append((time.process_time() - cpu_start) * 1e3)
                times.append((time.perf_counter() - start) * 1e3)
            print(
                f"{'system' if system else 'groups':>8} {name:>6} {tokens:>11} {statistics.median(times):>10.1f} "
                f"{statistics.median(cpu):>8.1f} {len(step_plan.cp_roots):>8}"
            )


if __name__ == "__main__":
    main()
