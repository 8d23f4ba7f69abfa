import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# `pytest -n N` (pytest-xdist, as `make test` runs it): N worker processes share the machine's cores, so each
# takes its share of torch's threads (and so do the commands a test starts), not all of them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compile processes per worker

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
def smollm_q8():
    """(SmolLM2-135M with its own weights and 8-bit activations, its tokenizer), once per module that asks; skips
    where the file is not (the fused decode tests)."""
    import attnlab
    from attnlab.model.qlinear import set_activations

    _, model, tokenizer = attnlab.load_model(smollm_file(), weights="native")
    return set_activations(model, "q8"), tokenizer


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
from helpers import PROBE_MODEL, smollm_file  # noqa: E402  (the probes' tiny model, the real model's path)

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


@pytest.fixture(scope="module")
def streaming_run(tmp_path_factory) -> Path:
    """A tiny trained run with a streaming memory (PROBE_MODEL, 16-token window, 2 sinks; char tokenizer, 2 steps):
    the probes' model for `memory ingest` and a memory streaming past max_seq_len."""
    from helpers import train_tiny_run

    memory = {"kind": "streaming", "recent_window": 16, "sink_tokens": 2}
    return train_tiny_run(tmp_path_factory.mktemp("memrun"), {**PROBE_MODEL, "memory": memory}, steps=2)


@pytest.fixture(autouse=True)
def lm_eval_defaults_indexed_once():
    """lm-eval indexes its own ~15,000 task files (about 14 s) each time a TaskManager includes them; those files
    do not change during a test session, so once lm_eval is imported each process indexes them once (the index of
    an include_path folder is still built fresh every time)."""
    if "lm_eval.tasks" in sys.modules:
        from helpers import index_lm_eval_defaults_once

        index_lm_eval_defaults_once()
    yield


def pytest_collection_modifyitems(config, items):
    """The files that hold tests marked slow run first (each file's tests in their order): pytest-xdist hands a
    worker a whole file at a time, so a long file left to the end would keep one worker busy alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each group is kept


@pytest.fixture
def file_size_limit():
    """limit(bytes): files larger than that cannot be written (as `ulimit -f`) until the test ends; writes past
    it fail with EFBIG instead of killing the process (SIGXFSZ ignored)."""
    import resource
    import signal

    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(size: int | None):
        resource.setrlimit(resource.RLIMIT_FSIZE, previous if size is None else (size, previous[1]))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, previous)
    signal.signal(signal.SIGXFSZ, handler)


@pytest.fixture
def unwritable(tmp_path):
    """tmp_path/ro, an existing folder nothing can be made in (chattr +i for root, whom chmod does not stop)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    root = os.geteuid() == 0
    if root and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    folder.chmod(0o555) if not root else None
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], capture_output=True) if root else folder.chmod(0o755)
