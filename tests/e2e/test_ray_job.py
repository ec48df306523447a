"""``examples/submit_cpu_job.sh`` against a Ray head started on 127.0.0.1 (``background``'s job run): the compare
script's augtree_sync run, cut after step 1, resumed as a job that is submitted, waited for and its logs read; the
head is stopped at the end (only the processes it started)."""

from __future__ import annotations

import pytest

from tests.e2e.runs import STEPS
from tests.e2e.test_resume import assert_resumed


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_a_submitted_cpu_job_resumes_the_sync_run(ray_job, sync_run):
    """The job's step 2 must be the sync run's step 2 (``test_resume``'s check: a resumed run on another Ray
    cluster)."""
    assert "succeeded" in ray_job.output.lower()
    # the job's logs, read back from the cluster
    assert f"step:{STEPS} - " in ray_job.logs and "actor/augtree/logical_tokens" in ray_job.logs
    (metrics,) = ray_job.steps
    assert_resumed(metrics, sync_run.steps[1], restored_groups=False)
