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


# The probes' shared fixtures (tests/test_bad_inputs_probe_*.py): a module opts in with
# `pytestmark = pytest.mark.usefixtures("one_thread", "offline")` or ("one_thread", "own_cache").
from helpers import PROBE_MODEL  # noqa: E402  (the probes' tiny model, for the fixtures below)

PROCESS_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ATTNLAB_CPU_KERNELS",
    "CC",
    "CXX",
)


@pytest.fixture
def offline(monkeypatch):
    """Nothing is fetched from the Hub."""
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory):
    """Prepared data and compiled kernels of a module in a folder of its own, never the user's cache; offline; no
    torchrun, kernel or compiler variables."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        patch.setenv("ATTNLAB_OFFLINE", "1")
        for name in PROCESS_VARIABLES:
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A tiny trained run (PROBE_MODEL, char tokenizer, 4 steps) at <root>/runs/tiny/seed0; its text at
    <root>/text.txt."""
    from helpers import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("tiny"), PROBE_MODEL, steps=4)
