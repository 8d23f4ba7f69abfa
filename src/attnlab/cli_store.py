"""`attnlab memory` (ingest documents into a memory state, list, remove, query it later) and the sampling flags it
shares with `attnlab generate`."""

from __future__ import annotations

from attnlab.cli_errors import Parser, check_greedy_flags
from attnlab.memory import MemoryStore, ingest, query
from attnlab.memory.store import check_ingest_options

REFERENCE_HELP = "an attnlab run or checkpoint folder, a .gguf file, a Hugging Face model folder, or hf:ORG/NAME[@REV]"


def cmd_memory_ingest(args) -> int:
    check_ingest_options(args.name, args.chunk)  # before the store is looked at
    store = MemoryStore(args.store)  # (made only when the state is written: a refused ingest leaves none behind)
    entry = ingest(store, args.model, args.documents, args.name, chunk=args.chunk, replace=args.replace,
                   data_dir=args.data_dir, progress=not args.no_progress)  # fmt: skip
    print(f"{entry.name}: {entry.tokens:,} tokens from {len(entry.documents)} document(s) -> "
          f"{store.path(entry)} ({entry.bytes:,} bytes, model config {entry.config_hash})")  # fmt: skip
    return 0


def cmd_memory_ls(args) -> int:
    """Every row of the index; one changed by hand (a damaged value, a file outside the store, a file gone or of
    another size than the index records) is marked with what is wrong and the `rm` that clears it, as the rest are
    listed (the other commands refuse it). Only sizes are compared: a state's checksum covers all its bytes, read
    by `query` (which refuses a state changed within its size), not by a listing of a store of any size."""
    store = MemoryStore(args.store, create=False)
    listed = store.rows()
    if not listed:
        print(f"no memories in {store.root}")
        return 0
    rows = [("name", "tokens", "bytes", "model hash", "created")]
    for name, e, _ in listed:  # (a damaged row's values are not shown: they are not what its state holds)
        rows.append(
            (e.name, f"{e.tokens:,}", f"{e.bytes:,}", e.config_hash, e.created) if e else (str(name), *("?",) * 4)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row, listing in zip(rows, [None, *listed], strict=True):  # numbers right-aligned
        cells = [row[i].rjust(w) if i in (1, 2) else row[i].ljust(w) for i, w in enumerate(widths)]
        name, entry, problem = listing or (None, None, None)
        if problem:
            cells.append(f"(its row was changed by hand into values the store never writes: {problem}; `attnlab "
                         f"memory rm {name}`)")  # fmt: skip
        elif entry is not None and not store.holds(entry):  # (a row changed by hand)
            cells.append(f"(its row names {entry.file}, not a state file of the store: `attnlab memory rm "
                         f"{entry.name}`)")  # fmt: skip
        elif entry is not None and not (store.root / entry.file).is_file():
            cells.append(f"(its state file {entry.file} is gone: `attnlab memory rm {entry.name}`)")
        elif entry is not None and (size := (store.root / entry.file).stat().st_size) != entry.bytes:
            cells.append(f"(its state file {entry.file} is {size:,} bytes, the index records {entry.bytes:,}: cut "
                         f"short or changed since the ingest; ingest it again with --replace, or `attnlab memory rm "
                         f"{entry.name}`)")  # fmt: skip
        print("  ".join(cells).rstrip())
    return 0


def cmd_memory_rm(args) -> int:
    name, file = MemoryStore(args.store, create=False).remove(args.name)
    kept = (
        "" if isinstance(file, str) and MemoryStore.holds_file(file) else ", a file outside the store: left where it is"
    )
    print(f"removed {name} ({file}{kept})")
    return 0


def cmd_memory_query(args) -> int:
    check_greedy_flags(args)
    store = MemoryStore(args.store, create=False)  # a query only reads the store
    text = query(store, args.name, args.prompt, model_path=args.model, data_dir=args.data_dir,
                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, seed=args.seed)  # fmt: skip
    print(args.prompt + text)
    return 0


def add_memory_parser(sub) -> None:
    common = Parser(add_help=False)
    common.add_argument("--store", default=None, help="the store folder (default $ATTNLAB_MEMORY, else "
                        "~/.cache/attnlab/memory)")  # fmt: skip
    memory = sub.add_parser("memory", help="memory files: ingest documents into a bounded memory, query it later")
    verbs = memory.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("ingest", parents=[common], help="read documents into a new memory state, stored by name")
    p.add_argument("model", help="a model reference (its model config must have a bounded memory): " + REFERENCE_HELP)
    p.add_argument("documents", nargs="+", help="UTF-8 text files, read in order")
    p.add_argument("--name", required=True, help="the name to store the state under")
    p.add_argument("--chunk", type=int, default=512, help="tokens per prefill step, 1 .. 2**31 - 1 (default 512)")
    p.add_argument("--replace", action="store_true", help="replace an existing memory of this name")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one shows on stderr after 2 s)")
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA)")
    p.set_defaults(func=cmd_memory_ingest)
    p = verbs.add_parser("ls", parents=[common], help="the stored memories")
    p.set_defaults(func=cmd_memory_ls)
    p = verbs.add_parser("rm", parents=[common], help="remove a stored memory")
    p.add_argument("name")
    p.set_defaults(func=cmd_memory_rm)
    p = verbs.add_parser("query", parents=[common], help="continue a prompt after a stored memory (left unchanged)")
    p.add_argument("name")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="use this model folder instead of the one recorded at ingestion")
    add_sampling_arguments(p, streams=True)
    p.add_argument("--data-dir", default=None, help="where data files are (else $ATTNLAB_DATA)")
    p.set_defaults(func=cmd_memory_query)


DEFAULT_NEW_TOKENS = 64


def add_sampling_arguments(p, streams: bool) -> None:
    """The flags of attnlab.generate.generate (it checks their values: a bad one is one line, exit code 2).
    streams: the model has a memory, which reads past max_seq_len."""
    if streams:
        default, limit = DEFAULT_NEW_TOKENS, "a model with a memory reads past max_seq_len: no limit"
    else:
        default, limit = None, ("or what max_seq_len leaves room for; the prompt and the new tokens stay within "
                                "max_seq_len: a larger number generates what fits and says so on stderr (a model "
                                "with a memory has no limit)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=default,
                   help=f"at most this many new tokens, >= 0 (default {DEFAULT_NEW_TOKENS}, {limit})")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, a finite number >= 0 (default 0: greedy, which --top-k, --top-p "
                        "and --seed would not change: they need a temperature > 0)")  # fmt: skip
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens, k >= 1 (default: all)")  # fmt: skip
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the most likely tokens whose probabilities add up to p, 0 < p <= 1 "
                        "(default: all)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling, 0 .. 2**64 - 1 (default: random)")
