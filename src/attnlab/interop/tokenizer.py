"""The tokenizer of a pretrained model, as an attnlab Tokenizer backed by the `tokenizers` library.

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

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from attnlab.data.files import atomic_write_text
from attnlab.data.tokenizers import Tokenizer
from attnlab.errors import ConfigError, DataError, InputError

# The ids a document ends with in pretraining, when the vocabulary has one (GPT-2 family, SmolLM, Llama 3);
# otherwise end-of-text is the end-of-sequence id.
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (tokenizer.ggml.token_type)

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


class PretrainedTokenizer(Tokenizer):
    """A pretrained model's tokenizer (`tokenizers.Tokenizer`) with the model's special ids.

    bos_id / eos_id: the model's begin- and end-of-sequence ids (None when it has none); add_bos: whether a
    prompt starts with BOS; eot_id: the id between documents (`<|endoftext|>` or `<|end_of_text|>` when
    the vocabulary has one, else eos_id); stop_ids: every id that ends a generation; chat_template: the
    model's Jinja chat template, or None."""

    def __init__(
        self,
        name: str,
        tokenizer: HFTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None = None,
    ):
        self.name = name
        self.tokenizer = tokenizer
        self.tokenizer.encode_special_tokens = True  # ordinary text: "<|endoftext|>" inside it is plain text
        self._prompt_tokenizer: HFTokenizer | None = None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_ids[0] if eos_ids else None
        end_of_text = [tokenizer.token_to_id(t) for t in END_OF_TEXT_TOKENS if tokenizer.token_to_id(t) is not None]
        eot_id = end_of_text[0] if end_of_text else self.eos_id
        if eot_id is None:
            raise DataError(f"{name}: the tokenizer has no end-of-sequence token (needed between documents)")
        self.eot_id = eot_id
        self._stop_ids = tuple(dict.fromkeys([*eos_ids, eot_id]))
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text, prompt=True)

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of `text` as one user turn of the model's chat template, ready for the assistant's answer: the
        Jinja template rendered and tokenized as transformers' apply_chat_template does (special tokens in it
        recognised, no BOS added beyond what the template writes). InputError without a template."""
        if not self.chat_template:
            raise InputError(f"{self.name}: the model has no chat template (leave out --chat)")
        import jinja2  # a dependency of torch; imported here only: chat prompts alone need it
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise InputError(f"{self.name}: the chat template refuses the prompt: {message}")

        environment.globals["raise_exception"] = raise_exception
        token = self.tokenizer.id_to_token
        try:
            rendered = environment.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": text}], add_generation_prompt=True,
                bos_token="" if self.bos_id is None else token(self.bos_id),
                eos_token="" if self.eos_id is None else token(self.eos_id),
            )  # fmt: skip
        except InputError:
            raise
        except (jinja2.TemplateError, ArithmeticError, TypeError, ValueError, RecursionError) as e:
            # ArithmeticError: range(10**12) overflows; the sandbox raises the Python errors a template causes
            raise DataError(f"{self.name}: its chat template does not render ({' '.join(str(e).split())})") from None
        return self.prompt_tokenizer.encode(rendered, add_special_tokens=False).ids

    @property
    def prompt_tokenizer(self) -> HFTokenizer:
        """A copy that recognises special tokens written in the text (chat templates write them)."""
        if self._prompt_tokenizer is None:
            self._prompt_tokenizer = HFTokenizer.from_str(self.tokenizer.to_str())
            self._prompt_tokenizer.encode_special_tokens = False
        return self._prompt_tokenizer

    def encode(self, text: str, *, prompt: bool = False) -> list[int]:
        """Token ids of `text`. prompt=True: as the model reads a prompt (BOS first when add_bos, special
        tokens in the text recognised), like transformers' `tokenizer(text).input_ids`."""
        if not prompt:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids = self.prompt_tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, folder: str | Path) -> None:
        """tokenizer.json and tokenizer_config.json, as a Hugging Face folder holds them (tokenizer_from_folder)."""
        folder = Path(folder)
        token = self.tokenizer.id_to_token
        config = {
            "bos_token": None if self.bos_id is None else token(self.bos_id),
            "eos_token": None if self.eos_id is None else token(self.eos_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        atomic_write_text(folder / "tokenizer.json", self.tokenizer.to_str())
        atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=1, ensure_ascii=False))


# ----------------------------------------------------------------------------- Hugging Face folders


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_id(tokenizer: HFTokenizer, token: Any) -> int | None:
    """The id of a tokenizer_config.json special token: a string, or {"content": string}."""
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def _ids(value: Any) -> list[int]:
    return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)] if value else []


def tokenizer_from_folder(folder: str | Path, name: str | None = None) -> PretrainedTokenizer:
    """The tokenizer of a Hugging Face model folder: tokenizer.json, with the special tokens, add_bos_token and
    chat template of tokenizer_config.json (else config.json's ids, and whether tokenizer.json adds BOS)."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"{path}: not found (the model folder needs its tokenizer.json)")
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise DataError(f"{path}: not a valid tokenizer.json ({' '.join(str(e).split())})") from None
    settings = _read_json(folder / "tokenizer_config.json")
    config = {**_read_json(folder / "config.json"), **_read_json(folder / "generation_config.json")}
    bos_id = _token_id(tokenizer, settings.get("bos_token"))
    bos_id = bos_id if bos_id is not None else next(iter(_ids(config.get("bos_token_id"))), None)
    eos = _token_id(tokenizer, settings.get("eos_token"))
    eos_ids = list(dict.fromkeys(([eos] if eos is not None else []) + _ids(config.get("eos_token_id"))))
    add_bos = settings.get("add_bos_token")
    if add_bos is None:  # does tokenizer.json's post-processor put BOS first?
        with_specials = tokenizer.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and with_specials[:1] == [bos_id]
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return PretrainedTokenizer(
        name or f"hf:{folder.name}", tokenizer, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos,
        chat_template=template,
    )  # fmt: skip


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
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges") or ()]
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
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    elif meta.get("tokenizer.ggml.scores"):
        merges = merges_from_scores(tokens, meta["tokenizer.ggml.scores"])
    else:
        raise DataError(f"{source}: a SentencePiece vocabulary without merges or scores")
    vocab = {token: i for i, token in enumerate(tokens)}
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
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return PretrainedTokenizer(
        name or f"gguf:{Path(source).name}", tokenizer, bos_id=bos_id, eos_ids=[] if eos_id is None else [eos_id],
        add_bos=add_bos, chat_template=meta.get("tokenizer.chat_template"),
    )  # fmt: skip
