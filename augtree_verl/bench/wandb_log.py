"""``--wandb``: one W&B run per method, in one group per bench invocation, so dashboards compare them.

Offline (files under ./wandb, sync later with ``wandb sync``) unless the user has credentials; an explicit
``WANDB_MODE`` wins.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from augtree_verl.bench.runner import MethodResult

PROJECT = "augtree-bench"


def log_runs(results: Sequence[MethodResult], config: dict) -> str:
    """Log ``results``; returns the mode used ("online" or "offline")."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if wandb.login(prompt=False, verify=False) else "offline")
    group = f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    for method in dict.fromkeys(r.method for r in results):
        run = wandb.init(
            project=PROJECT,
            group=group,
            name=method,
            job_type="bench",
            mode=mode,  # type: ignore[arg-type]  # WANDB_MODE: any mode wandb takes
            config={**config, "method": method},
            reinit="create_new",
            settings=wandb.Settings(quiet=True),
        )
        for r in (r for r in results if r.method == method):
            metrics = {
                "step_time_s": r.step_time_s,
                "speedup_vs_megan": r.speedup_vs_megan,
                "executed_tokens": r.executed_tokens,
                "logical_tokens": r.logical_tokens,
                "comm_bytes": r.comm_bytes,
                "peak_bytes": r.max_peak_bytes,
                "max_grad_rel_err": r.max_grad_rel_err,
                "ideal_speedup": r.ideal_speedup,
                "wrong": int(r.wrong),
            }
            run.log({f"{r.workload}/{k}": v for k, v in metrics.items()})
            run.summary[f"{r.workload}/plan"] = r.plan
        run.finish()
    return mode
