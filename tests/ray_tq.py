"""A module-scoped Ray instance (2 CPUs) with a one-storage-unit TransferQueue, as verl's trainer sets them up."""

import pytest
import ray
import transfer_queue as tq
from omegaconf import OmegaConf


@pytest.fixture(scope="module")
def ray_tq():
    ray.init(num_cpus=2, include_dashboard=False)
    tq.init(
        OmegaConf.create(
            {
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {"total_storage_size": 4096, "num_data_storage_units": 1},
                }
            }
        )
    )
    yield
    tq.close()
    ray.shutdown()
