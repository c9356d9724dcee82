import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("TNDEBUG_TEST_THREADS", "1")))

pytest_plugins = ["pytester"]     # tests/api: the pytest plugin run inside pytest


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
