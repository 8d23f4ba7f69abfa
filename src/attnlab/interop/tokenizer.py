"""The tokenizer of a pretrained model from GGUF metadata (attnlab.data.pretrained holds the class, and reads
Hugging Face folders).

    tokenizer = tokenizer_from_folder("path/to/hf-folder")          # tokenizer.json (+ tokenizer_config.json)
    tokenizer = tokenizer_from_gguf(open_gguf(path).metadata)        # rebuilt from tokenizer.ggml.* metadata
    ids = tokenizer.encode(text)                 # ordinary text: no BOS, special-token text stays plain text
    ids = tokenizer.encode(prompt, prompt=True)  # as the model reads a prompt: BOS first when the model wants
                                                 # one (add_bos), special tokens written in the text recognised

A GGUF file carries its vocabulary, merges and special ids but no tokenizer.json. `tokenizer.ggml.model`
says which kind: `gpt2` is byte-level BPE, pre-tokenized by the regex `tokenizer.ggml.pre` names (llama.cpp's
table in llama-vocab.cpp); `llama` is SentencePiece-style BPE over U+2581-marked words with byte fallback,
its merges taken from the file or derived from the token scores (as transformers' GGUF converter does).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from attnlab.data.pretrained import PretrainedTokenizer
from attnlab.data.tokenizers import CharTokenizer, WordTokenizer
from attnlab.errors import AttnlabWarning, ConfigError, DataError
from attnlab.paths import brief

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types (tokenizer.ggml.token_type)

# Pre-tokenizer regexes, as the models' own tokenizer.json files split text (llama.cpp: llama-vocab.cpp).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how a byte-level BPE splits text before merging: GPT-2's regex ("gpt2"), single digits
# then GPT-2's regex ("digits": SmolLM, StarCoder), or a regex of its own.
PRE_TOKENIZERS = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
    "dbrx": LLAMA3_SPLIT, "falcon3": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
}  # fmt: skip


# ----------------------------------------------------------------------------- GGUF metadata


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the printable character standing for each byte in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(meta: dict, source: str) -> HFTokenizer:
    """tokenizer.ggml.model gpt2: byte-level BPE, split first as tokenizer.ggml.pre says."""
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise ConfigError(f"tokenizer.ggml.pre={pre!r} is not supported (supported: {known})", source=source)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (written as plain UTF-8 by some converters) is spelled in it.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): i
        for i, token in enumerate(meta["tokenizer.ggml.tokens"])
    }
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merged = next((t for t, kind in zip(tokens, types, strict=False) if kind == NORMAL and len(t) > 1), None)
    if meta.get("tokenizer.ggml.merges") is None and merged is not None:  # (llama.cpp refuses a file without
        # merges): its tokens of more than one byte could never be made, and text would be read a byte a token
        raise DataError(f"{source}: tokenizer.ggml.model='gpt2' (byte-level BPE) without tokenizer.ggml.merges, "
                        f"while tokens such as {merged!r} need them: the file is damaged or was written without its "
                        "merges; convert the model again with its tokenizer")  # fmt: skip
    merges = checked_merges(meta.get("tokenizer.ggml.merges") or (), vocab, source)
    tokenizer = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
    if split == "gpt2":
        tokenizer.pre_tokenizer = byte_level
    elif split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def checked_merges(merges, vocab: dict[str, int], source: str) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges ("left right" strings) as pairs; DataError (one line naming the file and the merge) for
    one that is not two tokens, or that names a token (either part, or the two joined) the vocabulary lacks, which
    the tokenizers library would refuse with a traceback: a damaged file, or a token list cut short."""
    pairs = []
    for i, merge in enumerate(merges):
        pair = tuple(merge.split(" ", 1)) if isinstance(merge, str) else ()
        if len(pair) != 2 or not all(pair):
            raise DataError(f"{source}: tokenizer.ggml.merges[{i}]={merge!r} is not two tokens separated by a space "
                            "(the file is damaged)")  # fmt: skip
        missing = next((token for token in (*pair, pair[0] + pair[1]) if token not in vocab), None)
        if missing is not None:
            raise DataError(f"{source}: tokenizer.ggml.merges[{i}]={merge!r} names the token {missing!r}, which "
                            "is not in tokenizer.ggml.tokens (the file is damaged, or its token list was cut "
                            "short)")  # fmt: skip
        pairs.append(pair)
    return pairs


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges implied by a vocabulary: every split of a token into two tokens, best score first
    (ties: longer left piece, then longer right piece first), as transformers' generate_merges orders them."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        merges += sorted(pairs, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece(meta: dict, source: str) -> HFTokenizer:
    """tokenizer.ggml.model llama: BPE over words marked with U+2581, unknown bytes as <0xXX> tokens."""
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = checked_merges(meta["tokenizer.ggml.merges"], vocab, source)
    elif meta.get("tokenizer.ggml.scores"):
        merges = merges_from_scores(tokens, meta["tokenizer.ggml.scores"])
    else:
        raise DataError(f"{source}: a SentencePiece vocabulary without merges or scores")
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    add_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if add_space else []))
    return tokenizer


GGUF_TOKENIZERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def tokenizer_from_gguf(meta: dict, source: str = "gguf", name: str | None = None) -> PretrainedTokenizer:
    """The tokenizer a GGUF file's tokenizer.ggml.* metadata describes (ConfigError for kinds not supported)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in GGUF_TOKENIZERS:
        known = ", ".join(GGUF_TOKENIZERS)
        raise ConfigError(f"tokenizer.ggml.model={kind!r} is not supported (supported: {known})", source=source)
    if not meta.get("tokenizer.ggml.tokens"):
        raise DataError(f"{source}: no tokenizer.ggml.tokens in the metadata")
    check_token_list(meta["tokenizer.ggml.tokens"], source)
    check_per_token_arrays(meta, source)
    tokenizer = GGUF_TOKENIZERS[kind](meta, source)
    # Control tokens (<|im_start|>, <s>) are special: matched whole in prompts, plain text in ordinary text.
    # User-defined ones (<think>) are always matched whole, as llama.cpp does.
    types = meta.get("tokenizer.ggml.token_type") or ()
    tokens = meta["tokenizer.ggml.tokens"]
    alphabet = set(_byte_alphabet().values()) if kind == "gpt2" else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind_of in zip(tokens, types, strict=False)
        if kind_of == CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind_of in zip(tokens, types, strict=False)
        if kind_of == USER_DEFINED and tokenizer.token_to_id(token) is not None
    ]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)
    n_tokens = len(tokens)
    if tokenizer.get_vocab_size(with_added_tokens=True) != n_tokens:
        raise DataError(f"{source}: the rebuilt tokenizer has {tokenizer.get_vocab_size()} ids, not {n_tokens}")
    bos_id = special_id(meta, "bos", n_tokens, source)
    eos_id = special_id(meta, "eos", n_tokens, source)
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return PretrainedTokenizer(
        name or f"gguf:{Path(source).name}", tokenizer, bos_id=bos_id, eos_ids=[] if eos_id is None else [eos_id],
        add_bos=add_bos, chat_template=meta.get("tokenizer.chat_template"),
        template_source=f"{source} (tokenizer.chat_template)" if meta.get("tokenizer.chat_template") else source,
        source=source, eos_fix=f"tokenizer.ggml.eos_token_id is not set: set it (gguf-set-metadata {source} "
        "tokenizer.ggml.eos_token_id ID)",
    )  # fmt: skip


def check_token_list(tokens, source: str) -> None:
    """DataError (one line naming the file, the key and what it holds) unless tokenizer.ggml.tokens is an array of
    strings: anything else would be read as something it is not (a string as one token per character), and the
    error would name whatever stumbled on it first (the merges)."""
    if not isinstance(tokens, list):
        kind = "a string" if isinstance(tokens, str) else f"a {type(tokens).__name__}"
        raise DataError(f"{source}: tokenizer.ggml.tokens is {kind} ({brief(tokens)}), not an array of strings (one "
                        "per token): the file is damaged; download or convert it again")  # fmt: skip
    wrong = next((i for i, token in enumerate(tokens) if not isinstance(token, str)), None)
    if wrong is not None:
        raise DataError(f"{source}: tokenizer.ggml.tokens[{wrong}]={brief(tokens[wrong])} is not a string (the "
                        "tokens must be an array of strings): the file is damaged; download or convert it "
                        "again")  # fmt: skip


PER_TOKEN_KEYS = ("tokenizer.ggml.token_type", "tokenizer.ggml.scores")  # one entry per token, by position


def check_per_token_arrays(meta: dict, source: str) -> None:
    """DataError (one line naming the file, both keys and both lengths) unless each of PER_TOKEN_KEYS the file has
    is an array as long as tokenizer.ggml.tokens: they are read by position, so a shorter one would leave the
    tokens past its end with no type (a CONTROL token no longer special) or no score, silently."""
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    for key in PER_TOKEN_KEYS:
        values = meta.get(key)
        if values is None:
            continue
        if not isinstance(values, list):
            raise DataError(f"{source}: {key} is {brief(values)}, not an array (one entry per token of "
                            "tokenizer.ggml.tokens): the file is damaged; download or convert it again")  # fmt: skip
        if len(values) != n_tokens:
            raise DataError(f"{source}: {key} holds {len(values):,} entries, tokenizer.ggml.tokens {n_tokens:,} "
                            "tokens: they go one per token, by position, so the tokens past the shorter array "
                            "would be read with no type or score (a control token no longer special): the file is "
                            "damaged; download or convert it again")  # fmt: skip


def special_id(meta: dict, which: str, n_tokens: int, source: str) -> int | None:
    """tokenizer.ggml.<which>_token_id (None when the file has none); DataError (one line naming the file, the key,
    its value and the vocabulary's size) unless it is the id of a token: an EOS past the vocabulary is never
    generated, so generation could never stop at it."""
    key = f"tokenizer.ggml.{which}_token_id"
    value = meta.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_tokens):
        return value
    raise DataError(f"{source}: {key}={brief(value)} is not a token id: the vocabulary (tokenizer.ggml.tokens) holds "
                    f"{n_tokens:,} tokens, ids 0 .. {n_tokens - 1}; the file is damaged: set the key to the model's "
                    f"{which.upper()} token (gguf-set-metadata FILE {key} ID) or download the file again")  # fmt: skip


# ----------------------------------------------------------------------------- text a vocabulary cannot spell


def unknown_pieces(tokenizer, text: str) -> list[str]:
    """The characters (a char tokenizer) or words (a word tokenizer) of `text` that its vocabulary does not hold
    and that it reads as <unk>, in order; [] for tokenizers that spell any text (bytes, BPE)."""
    return tokenizer.unknown(text)


def unknown_line(tokenizer, pieces: list[str], what: str, shown: int = 5) -> str:
    """'<what> holds 3 characters outside the model's char vocabulary, read as <unk>: 'é', '😀'' (the first
    `shown` distinct pieces)."""
    distinct = list(dict.fromkeys(pieces))
    listed = ", ".join(repr(p) for p in distinct[:shown]) + (", ..." if len(distinct) > shown else "")
    unit = "character" if isinstance(tokenizer, CharTokenizer) else "word"
    plural = "" if len(pieces) == 1 else "s"
    return (
        f"{what} holds {len(pieces):,} {unit}{plural} outside the model's {tokenizer.name} vocabulary, read as "
        f"<unk>: {listed}"
    )


def warn_unknown(tokenizer, text: str, what: str, stacklevel: int = 2) -> int:
    """An AttnlabWarning (one line) when `text` holds characters or words `tokenizer` reads as <unk>: how many and
    which (a few); returns how many. `what` names the text ("the prompt")."""
    pieces = unknown_pieces(tokenizer, text)
    if pieces:
        warnings.warn(unknown_line(tokenizer, pieces, what), AttnlabWarning, stacklevel=stacklevel + 1)
    return len(pieces)


def warn_unknown_tokens(tokenizer, tokens, what: str, stacklevel: int = 2) -> int:
    """An AttnlabWarning (one line) when token ids `tokens` (a sequence, numpy array or tensor) made by a char or
    word tokenizer hold its <unk> id: how many of them are; returns that number. `what` names the text."""
    ids = np.asarray(tokens)  # (N,)
    if not isinstance(tokenizer, (CharTokenizer, WordTokenizer)) or not ids.size:
        return 0
    unknown = int((ids == tokenizer.unk_id).sum())
    if unknown:
        unit = "characters" if isinstance(tokenizer, CharTokenizer) else "words"
        warnings.warn(f"{unknown:,} of the {ids.size:,} tokens of {what} ({100 * unknown / ids.size:.1f}%) are "
                      f"<unk>: {unit} the model's {tokenizer.name} vocabulary does not hold, so the figures on it "
                      "are over <unk>", AttnlabWarning, stacklevel=stacklevel + 1)  # fmt: skip
    return unknown
