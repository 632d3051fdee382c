import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):     # two workers share the cores: one intra-op thread each
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
