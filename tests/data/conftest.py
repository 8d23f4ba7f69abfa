import os
from pathlib import Path

import pytest

from attnlab.config import DataConfig
from attnlab.data import prepare

# The shared data directory beside the checkout, unless ATTNLAB_DATA points elsewhere (as tests/conftest.py).
SIBLING_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture(autouse=True)
def offline_and_private_cache(tmp_path, monkeypatch):
    """No test downloads anything or reads the user's own cache (~/.cache/attnlab)."""
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture(scope="session")
def shared_data():
    path = Path(os.environ.get("ATTNLAB_DATA", SIBLING_DATA))
    if not path.is_dir():
        pytest.skip(f"no data directory at {path} (set ATTNLAB_DATA)")
    return path


@pytest.fixture(scope="session")
def prepared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("prepared")


@pytest.fixture(scope="session")
def wikitext_word(shared_data, prepared_cache):
    """WikiText-2 (tokenized v1) with the word-level tokenizer, prepared once per session (~1 s)."""
    return prepare(DataConfig(source="wikitext2", tokenizer="word"), shared_data, prepared_cache, download=False)


@pytest.fixture(scope="session")
def shakespeare_byte(shared_data, prepared_cache):
    """Tiny Shakespeare as UTF-8 bytes, split by document hash (5% validation)."""
    return prepare(DataConfig(source="tinyshakespeare", tokenizer="byte"), shared_data, prepared_cache, download=False)
