import os
from pathlib import Path

import pytest

# The shared data directory beside the checkout (as on the project's machines and CI), unless
# ATTNLAB_DATA points elsewhere. Tests that need a data file skip when it is nowhere.
SIBLING_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def data_dir():
    path = Path(os.environ.get("ATTNLAB_DATA", SIBLING_DATA))
    if not path.is_dir():
        pytest.skip(f"no data directory at {path} (set ATTNLAB_DATA)")
    return path
