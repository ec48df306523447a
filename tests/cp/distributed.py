"""Run a test body on a real gloo process group of spawned CPU processes (free port per run)."""

from __future__ import annotations

import datetime
import gc
import os
import sys
import traceback

import torch
import torch.distributed as dist

from augtree_verl.testing import harness

# A hung collective should fail the test well inside pytest's own timeout, with a gloo error.
GLOO_TIMEOUT_S = 120


def _entry(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # spawn re-raises only the first failing rank, often a peer's "connection closed": log every rank's.
        print(f"---- rank {rank} of {world_size} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        # A caught exception's traceback (pytest.raises) is a reference cycle holding the frames' locals, a
        # ProcessGroup among them; left to the interpreter's exit, gloo's destructor aborts (SIGABRT,
        # "terminate called without an active exception") in about one run in eight. Free it first.
        gc.collect()
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """``fn(rank, world_size, *args)`` on every rank; an exception on any rank fails the caller. The ranks fork
    from the test harness's preloaded server (``harness.start_ranks``), each with this environment."""
    harness.start_ranks(_entry, (world_size, harness.free_port(), fn, args), world_size)
