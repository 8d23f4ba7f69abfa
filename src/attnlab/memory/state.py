"""A model's bounded memory state as one fixed-size safetensors file (CoDA-GQA-L §5.1, without pickle).

    tensors   layers.{i}.{name}: the buffers of the variant's cache layout, (B, H_kv, W + M, width) each (k
              and v for mha; with a KV policy each field's storage arrays, `<field>.<i>`), ring_positions
              (W,), memory_positions (B, M), and what the memory kind keeps besides: ring_values (B, W)
              (bounded: write gates, h2o: attention mass), exact_last_used (B, M_e) (bounded),
              heavy_scores (B, M_h) (h2o)
    metadata  "attnlab.memory": a JSON header (HEADER_KEY): format, schema_version, config_hash, weights_sha256
              (the model's weights, weights_digest), model, memory (the model's memory config and its slots),
              n_layers, batch, dtype, tokens, attnlab version, and sha256, the checksum of the rest of the
              header and every tensor (name, dtype, shape, bytes); padded with spaces to a multiple of 256
              characters so the file's size does not depend on how many tokens it has read

Writing goes to a temporary file renamed into place. Reading parses safetensors only (never pickle), checks
the checksum, then that the state was made for this model's config (`ModelConfig.config_hash`) and weights
(`weights_sha256`: a model retrained with the same config writes other memories; a state written before the
weights were recorded still loads, with a warning).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from attnlab import __version__
from attnlab.cache.base import ModelCache
from attnlab.cache.memories import MemoryCache
from attnlab.config import PRESSES
from attnlab.data.files import atomic_write_bytes, file_kind
from attnlab.errors import AttnlabWarning, DataError, InputError
from attnlab.jsonio import loads_json

FORMAT = "attnlab-memory-state"
SCHEMA_VERSION = 1
HEADER_KEY = "attnlab.memory"
# Tensors a memory cache holds that are not its state: one call's (the H2O scores' positions, the chunk's EMA
# rate). Any other tensor attribute must be in its `bookkeeping()`, or saving fails loudly rather than writing
# an incomplete state.
NOT_STATE = ("_eta", "_held_positions")
REQUIRED = {"config_hash": str, "memory": dict, "n_layers": int, "batch": int, "dtype": str, "tokens": int}


class MemoryStateError(DataError):
    """A memory state file cannot be written, read, or used with this model."""


class DamagedStateError(MemoryStateError):
    """A state file that is not the state as it was written (cut short, changed, another format or schema version):
    writing it again is the way out. `problem` is the message without that generic fix, for a caller that names
    its own commands (the memory store)."""

    def __init__(self, problem: str, fix: str = ""):
        self.problem = problem
        super().__init__(f"{problem} ({fix})" if fix else problem)


def require_memory(model) -> None:
    """Raises InputError unless the model has a bounded memory (only those have a fixed-size state)."""
    memory = model.cfg.memory
    if memory.slots is None or memory.kind in PRESSES:  # kind none, quest, a press: no fixed-size state
        raise InputError(
            f"this model has no bounded memory (memory.kind={memory.kind}): only memory.kind window, streaming, "
            "h2o and bounded keep a fixed-size state to save or load; use a model trained with one of those"
        )


def _checksum(header: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the header (without its checksum) and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_digest(model) -> str:
    """sha256 of the model's weights: every entry of its state dict (name, dtype, shape, bytes), in name order. The
    same weights give the same digest whatever file they were loaded from. (About 0.3 s per 500 MB.)"""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _memory_header(model) -> dict:
    cfg = model.cfg
    return {
        "config_hash": cfg.config_hash(),
        "memory": {**dataclasses.asdict(cfg.memory), "slots": cfg.memory.slots},
        "n_layers": cfg.n_layers,
    }


def save_state(path: str | Path, model, cache: ModelCache, model_path: str | None = None) -> dict:
    """Writes the memory state of every layer of `cache` (made by `model`) to `path`; returns the header.

    model_path: where the model lives (a run or checkpoint folder), recorded so a load can say which model a
    state was made for.
    """
    require_memory(model)
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder: give a file path for the memory state (e.g. "
                         f"{path / 'state.safetensors'})")  # fmt: skip
    if not isinstance(cache, ModelCache):
        raise InputError(f"cache must be a ModelCache (model.new_cache, or a forward's result), got "
                         f"{type(cache).__name__}")  # fmt: skip
    if len(cache.layers) != model.cfg.n_layers or not all(isinstance(x, MemoryCache) for x in cache.layers):
        raise InputError(f"the cache does not belong to this model: expected {model.cfg.n_layers} memory caches "
                         f"(model.new_cache), got {[type(x).__name__ for x in cache.layers]}")  # fmt: skip
    for layer in cache.layers:
        unknown = [name for name, value in vars(layer).items() if isinstance(value, torch.Tensor)
                   and name not in layer.bookkeeping() and name not in NOT_STATE]  # fmt: skip
        if unknown:
            raise MemoryStateError(f"{type(layer).__name__} holds tensors the state file does not know: {unknown} "
                                   "(add them to its bookkeeping() or to attnlab.memory.state.NOT_STATE)")  # fmt: skip
    tensors = {f"layers.{i}.{name}": tensor.detach().cpu().contiguous().clone()  # clone: no shared storage
               for i, layer in enumerate(cache.layers) for name, tensor in layer.state().items()}  # fmt: skip
    header = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        **_memory_header(model),
        "weights_sha256": weights_digest(model),
        "model": str(model_path) if model_path is not None else None,
        "batch": cache.layers[0].memory_positions.shape[0],
        "dtype": str(cache.layers[0].slots.dtype).removeprefix("torch."),
        "kv_policy": None if cache.layers[0].slots.policy is None else str(cache.layers[0].slots.policy),
        "tokens": cache.seen,
        "attnlab_version": __version__,
    }
    header["sha256"] = _checksum(header, tensors)
    text = json.dumps(header, sort_keys=True)
    text += " " * (-len(text) % 256)  # fixed size whatever the number of tokens (json ignores the spaces)
    blob = save_tensors(tensors, metadata={HEADER_KEY: text})

    atomic_write_bytes(path, blob, durable=True)  # an OSError (permissions, a full disk) names `path`
    return header


def read_state(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors) of a state file whose checksum holds; MemoryStateError naming the file otherwise."""
    path = Path(path)
    try:
        kind = file_kind(path)  # a FIFO would wait for a writer without end
        if kind is not None:
            raise MemoryStateError(f"{path}: is {kind}, not a memory state file (put the state file itself there)")
        blob = path.read_bytes()
    except OSError as e:
        raise MemoryStateError(f"{path}: cannot read the memory state ({e.strerror or e})") from None
    return parse_state(blob, path)


def parse_state(blob: bytes, path: str | Path = "<bytes>") -> tuple[dict, dict[str, torch.Tensor]]:
    """read_state on the file's bytes; `path` names them in errors."""
    damaged = f"{path}: not a readable memory state (truncated or damaged"
    try:
        tensors = load_tensors(blob)  # parses safetensors only: no code runs
    except SafetensorError as e:
        raise DamagedStateError(f"{damaged}: {e})") from None
    size = int.from_bytes(blob[:8], "little")  # safetensors: u64 header length, JSON header, tensor bytes
    try:
        metadata = loads_json(blob[8 : 8 + size]).get("__metadata__") or {}
    except json.JSONDecodeError as e:  # (safetensors read it, but not an integer too long for Python)
        raise DamagedStateError(f"{damaged}: {e})") from None
    if HEADER_KEY not in metadata:
        raise DamagedStateError(f"{path}: a safetensors file but not an attnlab memory state (no {HEADER_KEY!r})")
    try:
        header = loads_json(metadata[HEADER_KEY])
    except json.JSONDecodeError as e:
        raise DamagedStateError(f"{damaged}: header {e})") from None
    except RecursionError:
        raise DamagedStateError(f"{damaged}: header nested too deeply to read)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DamagedStateError(f"{damaged}: header is not an {FORMAT} header)")
    version = header.get("schema_version")
    if not isinstance(version, int):
        raise DamagedStateError(f"{damaged}: header has no schema_version)")
    if version != SCHEMA_VERSION:
        raise DamagedStateError(f"{path}: memory state schema version {version}, this attnlab reads version "
                                f"{SCHEMA_VERSION}: written by another attnlab, or damaged", "re-ingest the "
                                "documents")  # fmt: skip
    if _checksum(header, tensors) != header.get("sha256"):
        raise DamagedStateError(f"{path}: checksum mismatch: the memory state was modified or damaged after it "
                                "was written", "re-ingest the documents")  # fmt: skip
    wrong = [key for key, kind in REQUIRED.items() if not isinstance(header.get(key), kind)]
    if "weights_sha256" in header and not isinstance(header["weights_sha256"], str):
        wrong.append("weights_sha256")
    if wrong:
        raise DamagedStateError(f"{damaged}: header lacks {wrong})")
    return header, tensors


def load_state(path: str | Path, model) -> tuple[ModelCache, dict]:
    """A new ModelCache holding the state saved at `path`, on the model's device, and the file's header.

    Refuses a damaged file and a state made for another model config or other weights (the message names that
    config and, when recorded, the model's folder). The file is only read.
    """
    require_memory(model)
    header, tensors = read_state(path)
    ours = _memory_header(model)
    made_for = f" ({header['model']})" if header.get("model") else ""
    if header["config_hash"] != ours["config_hash"]:
        raise MemoryStateError(
            f"{path}: made for model config {header['config_hash']}{made_for}; this model's config is "
            f"{ours['config_hash']} (load it with the model it was made for, e.g. attnlab memory query --model)"
        )
    weights = header.get("weights_sha256")
    if weights is None:  # written before states recorded their weights
        warnings.warn(f"{path}: written before memory states recorded their model's weights: cannot check that this "
                      "model has the weights it was made with (ingest the documents again to record them)",
                      AttnlabWarning, stacklevel=2)  # fmt: skip
    elif weights != (mine := weights_digest(model)):
        raise MemoryStateError(
            f"{path}: made with other weights of this model config{made_for} (weights sha256 {weights[:12]}, this "
            f"model's {mine[:12]}): the model was retrained or replaced since; ingest the documents again with it "
            "(attnlab memory ingest ... --replace), or load the state with the weights it was made with"
        )
    param = next(model.parameters())
    dtype = getattr(torch, str(header["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise DamagedStateError(f"{path}: unknown dtype {header['dtype']!r} in its header")
    policy = header.get("kv_policy")  # the formats the slots are stored in (None: the dtype)
    if policy is not None and not isinstance(policy, str):
        raise DamagedStateError(f"{path}: kv_policy {policy!r} in its header is not a policy string")
    cache = model.new_cache(int(header["batch"]), dtype=dtype, device=param.device, policy=policy)
    for i, layer in enumerate(cache.layers):
        expected = layer.state()
        names = {f"layers.{i}.{name}" for name in expected}
        missing = sorted(names - tensors.keys())
        if missing:
            raise DamagedStateError(f"{path}: tensors {missing} missing for this model's memory")
        loaded = {}
        for name, fresh in expected.items():
            stored = tensors[f"layers.{i}.{name}"]
            if stored.shape != fresh.shape or stored.dtype != fresh.dtype:
                raise DamagedStateError(f"{path}: layers.{i}.{name} is {tuple(stored.shape)} {stored.dtype}, this "
                                        f"model's memory holds {tuple(fresh.shape)} {fresh.dtype}")  # fmt: skip
            loaded[name] = stored.to(param.device)
        layer.load(loaded, int(header["tokens"]))
    extra = sorted(tensors.keys() - {f"layers.{i}.{n}" for i, x in enumerate(cache.layers) for n in x.state()})
    if extra:
        raise DamagedStateError(f"{path}: tensors {extra[:3]} do not belong to this model's memory")
    cache.seen = int(header["tokens"])
    return cache, header
