import os
from pathlib import Path

import pytest
import torch

# The shared data directory beside the checkout (as on the project's machines and CI), unless
# ATTNLAB_DATA points elsewhere. Tests that need a data file skip when it is nowhere.
SIBLING_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def data_dir():
    path = Path(os.environ.get("ATTNLAB_DATA", SIBLING_DATA))
    if not path.is_dir():
        pytest.skip(f"no data directory at {path} (set ATTNLAB_DATA)")
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): a tiny model's
    matmuls gain nothing from extra threads and, on a busy machine, make a file up to 5x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
