"""The end-to-end runs, started in the background as the session starts.

A run is one or two ``main_ppo`` launches (``examples/*.sh``): about a minute each on 2 cores, mostly the start-up
of a dozen processes that import torch and verl, about one core's worth of work. Every run a selected test reads
starts with the session (``tests/conftest.py``); its launches take ``width`` slots in the order of ``RUNS``: one
slot while the other tests run (they need the cores too), two once the session reaches ``tests/e2e`` (collected
last), where the tests only wait for their runs. A test reads a run with ``Background.result``; what the run
raised (a launch that exited non-zero, with the tail of its output) is raised there, in every test that reads it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from augtree_verl.testing.harness import free_port
from augtree_verl.trainer.augtree_async import COLOCATE_ASYNC_MODE, SEPARATE_ASYNC_MODE
from tests.e2e.runs import AGENT_SIZES, LR, REPO, SAVE_EVERY_STEP, read_steps, run_env, stopped_after

# One launch runs 2 steps of a tiny model in about a minute on 2 cores; this bounds a hung one.
LAUNCH_TIMEOUT_S = 1100
# Launches at once while the session is in tests/e2e: two use the 2 cores (one launch is about one core's work).
E2E_WIDTH = 2
# The engines the vision run trains, one launch each (test_vision compares their step 1).
VISION_ENGINES = ("fsdp2", "augtree")
# How long the Ray head of the job run may take to answer ``ray job list``.
HEAD_START_S = 120
# The compare script's overrides, which the Ray job's resume of its augtree_sync run repeats.
COMPARED_OVERRIDES = (f"actor_rollout_ref.actor.optim.lr={LR}", *SAVE_EVERY_STEP)
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Run:
    """A finished run: its folder (the working directory, with ``checkpoints/``), its overrides, its steps."""

    dir: Path
    overrides: tuple[str, ...]
    steps: list[dict]


class Background:
    """The session's end-to-end runs: each started once, in a thread of its own, its launches behind one gate."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._gate = threading.Condition()
        self._width = 1
        self._running = 0
        self._waiting: list[int] = []  # the ranks in ``RUNS`` of the launches waiting for a slot
        self._stopped = False
        self._local = threading.local()
        self._procs: set[subprocess.Popen] = set()
        self._futures: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=len(RUNS), thread_name_prefix="e2e")
        self._assets: Path | None = None
        self._assets_lock = threading.Lock()

    @property
    def assets(self) -> Path:
        """The CPU task the runs train on (written once, on first use)."""
        with self._assets_lock:
            if self._assets is None:
                out = self._tmp.mktemp("cpu-loop")
                write_task("augtree_verl.cpu_loop.task", out, "--train-rows=8", "--test-rows=2")
                self._assets = out
        return self._assets

    def start(self, names: set[str]) -> None:
        """Start the runs ``names`` (and the runs they resume), in the order of ``RUNS``."""
        for name in RUNS:
            if name in names:
                self._submit(name)

    def result(self, name: str):
        """The run ``name``'s result, once it finished (started now if it was not)."""
        return self._submit(name).result()

    def widen(self, width: int) -> None:
        with self._gate:
            self._width = max(self._width, width)
            self._gate.notify_all()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One of the ``width`` launches that may run at once, given to the waiting run first in ``RUNS`` (a
        launch of the test's own: after them)."""
        rank = getattr(self._local, "rank", len(RUNS))
        with self._gate:
            self._waiting.append(rank)
            self._gate.wait_for(lambda: self._stopped or (self._running < self._width and rank == min(self._waiting)))
            self._waiting.remove(rank)
            if self._stopped:
                raise RuntimeError("the session ended before this launch could start")
            self._running += 1
            self._gate.notify_all()
        try:
            yield
        finally:
            with self._gate:
                self._running -= 1
                self._gate.notify_all()

    def launch(self, script: str, env: dict, cwd: Path, *overrides: str) -> str:
        """``examples/<script>`` with ``overrides``: its output (stdout and stderr) once it exited 0 (an
        assertion error with its tail otherwise)."""
        with self.slot():
            proc = subprocess.Popen(
                ["bash", str(REPO / "examples" / script), *overrides],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # its process group: stop() ends the launch and what it started
            )
            self._procs.add(proc)
            try:
                output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill(proc)
                output, _ = proc.communicate()
            finally:
                self._procs.discard(proc)
        assert proc.returncode == 0, f"{script} {' '.join(overrides)} exited {proc.returncode}:\n{output[-6000:]}"
        return output

    def concurrently(self, fn: Callable, items) -> list:
        """``fn`` over ``items``, each in a thread of its own whose launches wait for a slot with the calling
        run's rank (two slots run two at once)."""
        rank = self._local.rank

        def call(item):
            self._local.rank = rank
            return fn(item)

        with ThreadPoolExecutor(max_workers=len(items), thread_name_prefix="e2e-concurrent") as pool:
            return list(pool.map(call, items))

    def stop(self) -> None:
        """End the launches still running (a session stopped early), start no other, and end the threads."""
        with self._gate:
            self._stopped = True
            self._gate.notify_all()
        for proc in list(self._procs):
            _kill(proc)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, name: str) -> Future:
        if name not in self._futures:
            spec = RUNS[name]
            for needed in spec.after:
                self._submit(needed)
            self._futures[name] = self._pool.submit(self._run, name)
        return self._futures[name]

    def _run(self, name: str):
        spec = RUNS[name]
        self._local.rank = list(RUNS).index(name)
        return spec.make(self, self._tmp.mktemp(name), *(self.result(needed) for needed in spec.after))


def write_task(module: str, out: Path, *args: str) -> None:
    """``python -m <module> --out <out> <args>`` (a task's model and data, as ``examples/run_cpu.sh`` writes them), in
    a process of its own: the model's seeded random weights must not share this process's global RNG with the
    tests running here meanwhile (a vision model drawn so once lost its answer prior: every response ran to the
    length limit, and verl 0.9.1 cannot batch equal-length rows of 3D position ids, verl#7899)."""
    run = subprocess.run(
        [sys.executable, "-m", module, "--out", str(out), *args], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"{module} exited {run.returncode}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _compared(bg: Background, out: Path) -> Path:
    """OUT_DIR of ``examples/compare_engines.sh``: <engine>.jsonl, compare.png, wandb/, checkpoints/<engine>/,
    and log.txt (the script's output)."""
    log = bg.launch(
        "compare_engines.sh",
        run_env(bg.assets, out, OUT_DIR=str(out), WANDB_DIR=str(out), PROMPTS="short"),  # the test's own task
        out,
        *COMPARED_OVERRIDES,
    )
    (out / "log.txt").write_text(log)
    return out


def _mode_run(mode: str, *extra: str) -> Callable[[Background, Path], Run]:
    """A straight run of ``examples/run_cpu.sh`` in trainer mode ``mode``: 2 steps, a checkpoint after each."""

    def make(bg: Background, out: Path) -> Run:
        overrides = (f"trainer.v1.trainer_mode={mode}", f"actor_rollout_ref.actor.optim.lr={LR}", *SAVE_EVERY_STEP)
        log = out / "metrics.jsonl"
        bg.launch("run_cpu.sh", run_env(bg.assets, out, VERL_FILE_LOGGER_PATH=str(log)), out, *overrides, *extra)
        return Run(out, overrides + extra, read_steps(log))

    return make


def _resumed(bg: Background, out: Path, straight: Run) -> dict:
    """Step 2 of ``straight`` cut after step 1 (its folder with ``global_step_1`` only) and run again with
    ``trainer.resume_mode=auto``."""
    stopped_after(straight.dir, 1, out)
    log = out / "metrics.jsonl"
    env = run_env(bg.assets, out, VERL_FILE_LOGGER_PATH=str(log))
    bg.launch("run_cpu.sh", env, out, *straight.overrides, "trainer.resume_mode=auto")
    (step,) = read_steps(log)
    return step


def _dapo(bg: Background, out: Path) -> list[dict]:
    """One step of the DAPO recipe on our engine."""
    log = out / "metrics.jsonl"
    bg.launch(
        "run_cpu.sh", run_env(bg.assets, out, STEPS="1", RECIPE="dapo_augtree", VERL_FILE_LOGGER_PATH=str(log)), out
    )
    return read_steps(log)


def _agent(bg: Background, out: Path) -> Path:
    """OUT_DIR of ``examples/train_agent.sh`` at ``test_agent_loop``'s sizes, both engines: <engine>.jsonl,
    agent_loops.yaml, rollouts/<engine>/1.jsonl."""
    env = run_env(
        out,
        out,
        OUT_DIR=str(out),
        ASSETS_DIR_AGENT=str(out / "assets"),
        ENGINES="fsdp2 augtree",
        STEPS="1",
        NPROC="1",
        **{key: str(value) for key, value in AGENT_SIZES.items()},
    )
    bg.launch("train_agent.sh", env, out, "trainer.rollout_data_dir=rollouts/${actor_rollout_ref.actor.strategy}")
    return out


def _vision(bg: Background, out: Path) -> dict[str, list[dict]]:
    """``examples/run_cpu.sh`` with ``TASK=vision`` (the tiny vision-language model, the shape task) on each of
    ``VISION_ENGINES``, 2 steps: each engine's steps. The launches share the task (written first) and run at
    once (``Background.concurrently``)."""
    tokenizer = REPO / "tests" / "data" / "qwen2_5_tokenizer"
    write_task("augtree_verl.cpu_loop.vision_task", out / "assets", f"--tokenizer={tokenizer}")

    def launch(strategy: str) -> list[dict]:
        log = out / f"{strategy}.jsonl"
        env = run_env(out / "assets", out, TASK="vision", STRATEGY=strategy, VERL_FILE_LOGGER_PATH=str(log))
        bg.launch("run_cpu.sh", env, out, f"actor_rollout_ref.actor.optim.lr={LR}")
        return read_steps(log)

    return dict(zip(VISION_ENGINES, bg.concurrently(launch, VISION_ENGINES)))


def sync_run_of(compared: Path) -> Run:
    """The augtree_sync run of the compare script (our engine; the recipes' default trainer mode)."""
    return Run(compared, COMPARED_OVERRIDES, read_steps(compared / "augtree.jsonl"))


@dataclass(frozen=True)
class RayJob:
    """The job run: the submit script's output, the job's logs read back from the cluster, its steps' metrics."""

    output: str
    logs: str
    steps: list[dict]


@contextlib.contextmanager
def _ray_head(out: Path) -> Iterator[tuple[str, dict]]:
    """(dashboard address, environment for Ray's CLI) of ``ray start --head --block`` on 127.0.0.1 with its own
    temp dir (so no other ray.init() here joins it) and ports; stopped at the end (only what it started)."""
    temp_dir = tempfile.mkdtemp(prefix="rayhead-", dir="/tmp")  # short: Ray's socket paths have a length limit
    dashboard = free_port()
    ports = ("port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "ray-client-server-port")
    ports += ("metrics-export-port", "runtime-env-agent-port")
    args = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        *(f"--{name}={free_port()}" for name in ports),
        f"--temp-dir={temp_dir}",
        "--num-cpus=16",
        "--num-gpus=2",
        "--disable-usage-stats",
    ]
    # Ray 2.60 turns token authentication on for `ray start` when ~/.ray/auth_token exists but leaves its CLI
    # clients off unless RAY_AUTH_MODE says so: set the mode explicitly (off: a head on 127.0.0.1 for a test).
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    log = out / "head.log"
    proc = subprocess.Popen(args, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + HEAD_START_S
        while (
            subprocess.run(
                [str(BIN / "ray"), "job", "list", "--address", address], env=env, capture_output=True, timeout=60
            ).returncode
            != 0
        ):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(2)
        yield address, env
    finally:
        # --block: on SIGINT the command stops the Ray processes it started, and only those.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _ray_job(bg: Background, out: Path, compared: Path) -> RayJob:
    """``examples/submit_cpu_job.sh`` against a Ray head started here: the compare script's augtree_sync run cut
    after step 1 (``stopped_after``) and resumed as a job; the head's start-up waits for no slot (it idles)."""
    sync_run = sync_run_of(compared)
    stopped_after(sync_run.dir, 1, out)
    checkpoints = next(out.glob("checkpoints/augtree"))
    log = out / "metrics.jsonl"
    with _ray_head(out) as (address, env):
        env = dict(
            run_env(bg.assets, out, VERL_FILE_LOGGER_PATH=str(log)),
            RAY_ADDRESS=address,
            PATH=env["PATH"],
            RAY_AUTH_MODE=env["RAY_AUTH_MODE"],
        )
        # the job runs in Ray's copy of the repository: the checkpoint folder by its absolute path
        output = bg.launch(
            "submit_cpu_job.sh",
            env,
            out,
            *sync_run.overrides,
            f"trainer.default_local_dir={checkpoints}",
            "trainer.resume_mode=auto",
        )
        submitted = [line for line in output.splitlines() if "submitted successfully" in line]
        assert submitted, f"no job id in the submit script's output:\n{output[-6000:]}"
        logs = subprocess.run(
            [str(BIN / "ray"), "job", "logs", submitted[0].split("'")[1], "--address", address],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    return RayJob(output, logs, read_steps(log))


@dataclass(frozen=True)
class RunSpec:
    make: Callable  # (background, its folder, *the results of ``after``) -> its result
    after: tuple[str, ...] = ()  # the runs it resumes


# In the order they get a slot: the straight runs that are resumed, each resume as soon as it can start, then the
# others (the resumes keep both slots busy at the end).
RUNS: dict[str, RunSpec] = {
    "colocate_async": RunSpec(_mode_run(COLOCATE_ASYNC_MODE)),
    # Without verl's warm-up batch: each step's batch is sampled after the previous step's weights were pushed
    # to the rollout pool, so step 1 trains the dataloader's first batch (as the sync trainer does: comparable
    # with the stock engine) and step 2's rollout shows the pushed weights. colocate_async keeps the warm-up batch.
    "separate_async": RunSpec(_mode_run(SEPARATE_ASYNC_MODE, "trainer.v1.separate_async.num_warmup_batches=0")),
    "resumed_colocate_async": RunSpec(_resumed, after=("colocate_async",)),
    "resumed_separate_async": RunSpec(_resumed, after=("separate_async",)),
    "compared": RunSpec(_compared),
    "ray_job": RunSpec(_ray_job, after=("compared",)),
    "agent": RunSpec(_agent),
    "dapo": RunSpec(_dapo),
    "vision": RunSpec(_vision),
}


# The session fixtures (tests/e2e/conftest.py) that read each run: a selected test needing one starts the run.
RUN_OF_FIXTURE = {
    "compared": "compared",
    "colocate_async_run": "colocate_async",
    "separate_async_run": "separate_async",
    "agent_runs": "agent",
    "dapo_steps": "dapo",
    "vision_steps": "vision",
    "resumed_colocate_async": "resumed_colocate_async",
    "resumed_separate_async": "resumed_separate_async",
    "ray_job": "ray_job",
}
