import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("TNDEBUG_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
