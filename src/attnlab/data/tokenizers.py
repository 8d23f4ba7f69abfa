"""Tokenizers: `gpt2` (tiktoken), `bpe:<N>` (byte-level BPE trained with `tokenizers`), `word`, `byte`, `char`.

Every tokenizer has `name`, `vocab_size`, `eot_id` (the end-of-text id put between documents),
`encode(str) -> list[int]`, `encode_batch(list[str]) -> list[list[int]]`, `decode(ids) -> str` and
`save(folder)`. Encoding is "ordinary": the text `<|endoftext|>` inside a document is plain text, never the
end-of-text id, so no document can forge a document boundary.

`bpe:<N>`, `word` and `char` are fitted to a corpus (the training split only: `train_tokenizer`) and saved
next to the prepared token files; `gpt2` and `byte` are fixed. `load_tokenizer(name, folder)` rebuilds any
of them from a prepared folder.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import operator
import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from attnlab.config import names_model, tokenizer_name_problem
from attnlab.data.files import atomic_write_bytes, atomic_write_text, downloads_allowed, sha256_file
from attnlab.errors import ConfigError, DataError, InputError, VocabularyWarning, given
from attnlab.jsonio import loads_json
from attnlab.paths import data_dirs

EOT = "<|endoftext|>"
UNK = "<unk>"
EOS = "<eos>"  # WikiText's end-of-line token, as pytorch's word_language_model counts it
KINDS = ("gpt2", "bpe:<N>", "word", "byte", "char")

# GPT-2's pre-tokenizer regex and the sha256 of its BPE files (the hashes tiktoken itself checks).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "r50k_base.tiktoken": "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
}
GPT2_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
GPT2_EOT_ID = 50256


class Tokenizer:
    """Base class: subclasses set name, vocab_size, eot_id and implement encode/decode (and save if fitted)."""

    name: str
    vocab_size: int
    eot_id: int
    file: str | None = None  # the one file `save` writes, if any

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in checked_texts(texts)]

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, as the model reads one (a pretrained model's BOS first where it expects it)."""
        return self.encode(text)

    def unknown(self, text: str) -> list[str]:
        """The pieces of `text` this tokenizer reads as <unk> (characters or words its vocabulary lacks), in order,
        each time they occur: what a prompt would lose without a word. Nothing for tokenizers that spell any text
        (bytes, BPE)."""
        return []

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generation: end-of-text (a pretrained model's end-of-sequence ids too)."""
        return (self.eot_id,)

    def save(self, folder: str | Path) -> None:
        """Writes what `load_tokenizer(self.name, folder)` needs (nothing for fixed tokenizers)."""

    @property
    def files(self) -> tuple[str, ...]:
        """The names of the files `save` writes (a prepared folder's meta.json records their sha256)."""
        return (self.file,) if self.file else ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def checked_text(text) -> str:
    """`text`, after an InputError unless it is a str (encode's argument)."""
    if not isinstance(text, str):
        raise InputError(f"encode takes a str, got {given(text)} (to encode several texts, "
                         "use encode_batch)")  # fmt: skip
    return text


def checked_texts(texts) -> list[str]:
    """`texts` as a list, after an InputError unless it is a list (or other iterable) of str (_strings)."""
    return list(_strings(texts))


def checked_ids(ids) -> list[int]:
    """`ids` as a list of ints, after an InputError unless they are whole numbers >= 0 (decode's argument: a sequence
    of token ids; ids past the vocabulary are left to the tokenizer, which shows them as U+FFFD, as a model whose
    vocab_size is larger than its tokenizer's may sample one)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InputError(f"decode takes a sequence of token ids (whole numbers), got {given(ids)}")  # fmt: skip
    values = list(ids)
    bad = [i for i in values if not _is_index(i)][:1]
    if bad:
        raise InputError(f"decode takes token ids (whole numbers), got {given(bad[0])} among them")
    ids = [operator.index(i) for i in values]
    if ids and min(ids) < 0:
        raise InputError(f"token id {min(ids)} is negative: token ids are whole numbers >= 0")
    return ids


def _is_index(value) -> bool:
    """Whether `value` is a whole number: not a float, nor a bool (or a bool tensor), which would read as id 0 or 1."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "torch.bool":
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: ids 0..255 are the bytes, 256 is end-of-text."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(checked_text(text).encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        pieces, run = [], bytearray()
        for i in checked_ids(ids):
            if i < 256:
                run.append(i)
                continue
            # 256 is end-of-text; an id past the vocabulary (a padded model may sample one) shows as U+FFFD
            pieces.append(run.decode("utf-8", errors="replace") + (EOT if i == self.eot_id else "\ufffd"))
            run = bytearray()
        return "".join(pieces) + run.decode("utf-8", errors="replace")


class VocabTokenizer(Tokenizer):
    """A tokenizer defined by a token list (`word`, `char`); saved as `vocab.json` in the folder."""

    file = "vocab.json"

    def __init__(self, tokens: list[str]):
        self.tokens = list(tokens)
        self.ids = {token: i for i, token in enumerate(self.tokens)}
        if len(self.ids) != len(self.tokens) or UNK not in self.ids or EOT not in self.ids:
            raise DataError(f"{self.name} vocabulary must hold distinct tokens including {UNK} and {EOT}")
        self.vocab_size = len(self.tokens)
        self.unk_id = self.ids[UNK]
        self.eot_id = self.ids[EOT]

    def save(self, folder: str | Path) -> None:
        blob = json.dumps({"name": self.name, "tokens": self.tokens}, ensure_ascii=False)
        atomic_write_text(Path(folder) / self.file, blob)


class CharTokenizer(VocabTokenizer):
    """Characters of the training split (sorted), then `<unk>` (any other character) and end-of-text."""

    name = "char"

    def __init__(self, tokens: list[str]):
        super().__init__(tokens)
        for i, token in enumerate(self.tokens):  # (encode reads one character at a time: a longer token never matches)
            if len(token) != 1 and token not in (UNK, EOT):
                raise DataError(f"char vocabulary must hold single characters besides {UNK} and {EOT}, but token {i} "
                                f"is {token!r}")  # fmt: skip

    @classmethod
    def fit(cls, texts: Iterable[str]) -> CharTokenizer:
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls(sorted(chars) + [UNK, EOT])

    def encode(self, text: str) -> list[int]:
        ids, unk = self.ids, self.unk_id
        return [ids.get(c, unk) for c in checked_text(text)]

    def unknown(self, text: str) -> list[str]:
        return [c for c in text if c not in self.ids]

    def decode(self, ids: Sequence[int]) -> str:
        # One unknown character, or an id past the vocabulary (a model whose vocab_size is larger than its
        # tokenizer's may sample one), decodes to U+FFFD, as undecodable bytes do.
        size = len(self.tokens)
        return "".join(self.tokens[i] if 0 <= i < size and i != self.unk_id else "\ufffd" for i in checked_ids(ids))


class WordTokenizer(VocabTokenizer):
    """WikiText's word-level vocabulary, as pytorch's word_language_model builds it: whitespace-split words
    and `<eos>` for every line end, ids in first-occurrence order over the training split; words never seen
    in training map to `<unk>`; end-of-text is the last id."""

    name = "word"
    pattern = re.compile(r"\n|[^\s]+")

    def __init__(self, tokens: list[str]):
        super().__init__(tokens)
        if EOS not in self.ids:
            raise DataError(f"word vocabulary must hold {EOS}")
        self.lookup = dict(self.ids)
        self.lookup["\n"] = self.ids[EOS]
        del self.lookup[EOT]  # the text "<|endoftext|>" is a plain (unknown) word

    @classmethod
    def fit(cls, texts: Iterable[str]) -> WordTokenizer:
        first_seen: dict[str, None] = {}
        for text in texts:
            for word in cls.pattern.findall(text):
                first_seen.setdefault(EOS if word == "\n" else word)
        first_seen.pop(EOT, None)
        for special in (EOS, UNK, EOT):  # WikiText's train split already holds <unk>; others get it appended
            first_seen.setdefault(special)
        return cls(list(first_seen))

    def encode(self, text: str) -> list[int]:
        lookup, unk = self.lookup, self.unk_id
        return [lookup.get(word, unk) for word in self.pattern.findall(checked_text(text))]

    def unknown(self, text: str) -> list[str]:
        return [word for word in self.pattern.findall(text) if word not in self.lookup]

    def decode(self, ids: Sequence[int]) -> str:
        """Words joined by one space, `<eos>` as a line end (the text's own spacing is not kept)."""
        pieces, line_start = [], True
        for i in checked_ids(ids):
            token = self.tokens[i] if 0 <= i < len(self.tokens) else "\ufffd"  # past the vocabulary: U+FFFD
            if token == EOS:
                pieces.append("\n")
                line_start = True
                continue
            pieces.append(token if line_start else " " + token)
            line_start = False
        return "".join(pieces)


class TiktokenTokenizer(Tokenizer):
    """GPT-2's BPE through tiktoken (50,257 ids, end-of-text 50256); saved as `gpt2.tiktoken`."""

    file = "gpt2.tiktoken"

    def __init__(self, ranks: dict[bytes, int]):
        self.ranks = ranks
        self.encoding = tiktoken.Encoding(
            name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: GPT2_EOT_ID}
        )
        self.name = "gpt2"
        self.vocab_size = self.encoding.n_vocab
        self.eot_id = GPT2_EOT_ID

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(checked_text(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(checked_texts(texts), num_threads=os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        pieces, run = [], []
        for i in checked_ids(ids):
            if 0 <= i < self.encoding.n_vocab:
                run.append(i)
            else:  # past the vocabulary (a model whose vocab_size is larger may sample one): U+FFFD
                pieces += [self.encoding.decode(run), "\ufffd"]
                run = []
        return "".join(pieces) + self.encoding.decode(run)

    def save(self, folder: str | Path) -> None:
        # The r50k_base.tiktoken format: base64(token bytes) rank, one per line in rank order.
        lines = (base64.b64encode(token) + b" " + str(rank).encode() for token, rank in _by_rank(self.ranks))
        atomic_write_bytes(Path(folder) / self.file, b"\n".join(lines) + b"\n")


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style pre-tokenizer) from the `tokenizers` library; saved as `tokenizer.json`."""

    file = "tokenizer.json"

    def __init__(self, name: str, tokenizer):
        self.name = name
        self.tokenizer = tokenizer
        self.tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a document is plain text
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = tokenizer.token_to_id(EOT)
        if self.eot_id is None:
            raise DataError(f"{name} tokenizer has no {EOT} token")

    @classmethod
    def fit(cls, name: str, texts: Iterable[str]) -> BPETokenizer:
        tokenizer = HFTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=bpe_vocab_size(name),
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(name, tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(checked_text(text), add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(checked_texts(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(checked_ids(ids), skip_special_tokens=False)

    def save(self, folder: str | Path) -> None:
        atomic_write_text(Path(folder) / self.file, self.tokenizer.to_str())


def _by_rank(ranks: dict[bytes, int]) -> list[tuple[bytes, int]]:
    return sorted(ranks.items(), key=lambda item: item[1])


def check_tokenizer_name(name: str) -> None:
    """ConfigError unless `name` is a tokenizer's name (config.tokenizer_name_problem)."""
    problem = tokenizer_name_problem(name)
    if problem:
        raise ConfigError(problem)


def bpe_vocab_size(name: str) -> int:
    check_tokenizer_name(name)
    return int(name[4:])


def needs_training(name: str) -> bool:
    """True for tokenizers fitted to a training split (bpe:<N>, word, char)."""
    check_tokenizer_name(name)
    return name.startswith("bpe:") or name in ("word", "char")


def train_tokenizer(name: str, texts: Iterable[str]) -> Tokenizer:
    """Fits a `bpe:<N>`, `word` or `char` tokenizer on `texts`, an iterable of str (pass the training split's
    documents only). A BPE the text allows fewer than N ids warns (VocabularyWarning) and keeps what it could learn."""
    if not isinstance(name, str):
        raise InputError(f"tokenizer name must be a str ({', '.join(KINDS)}), got {given(name)}")
    if not needs_training(name):  # (which checks the name)
        raise ConfigError(f"tokenizer={name!r} is fixed, not trained (use load_tokenizer)")
    return fit_tokenizer(name, _some_text(_strings(texts)))


def fit_tokenizer(name: str, texts: Iterable[str]) -> Tokenizer:
    """train_tokenizer's fit of a checked `name` to `texts` (str), which may hold no text: prepare() says an empty
    source as such once it has read every split."""
    if name.startswith("bpe:"):
        tokenizer = BPETokenizer.fit(name, texts)
        if tokenizer.vocab_size < bpe_vocab_size(name):
            warnings.warn(f"tokenizer {name}: the training text allowed only {tokenizer.vocab_size} of the "
                          f"{bpe_vocab_size(name)} ids asked (train it on more text, or ask for fewer)",
                          VocabularyWarning, stacklevel=3)  # fmt: skip
        return tokenizer
    if name == "word":
        return WordTokenizer.fit(texts)
    if name == "char":
        return CharTokenizer.fit(texts)
    raise ConfigError(f"tokenizer={name!r} is fixed, not trained (use load_tokenizer)")


def _strings(texts: Iterable) -> Iterator[str]:
    """`texts`, read lazily (a training split may not fit in memory): an InputError unless it is an iterable of str
    (a bare str would be read as one-character texts), said at once, or at the first item that is no str."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Iterable):
        raise InputError(f"texts must be a list of strings (or another iterable of them), got {given(texts)} (a "
                         "single text: give [text])")  # fmt: skip
    return _each_string(texts)


def _some_text(texts: Iterator[str]) -> Iterator[str]:
    """`texts` (read as far as their first non-empty one), after an InputError if none holds any text: a tokenizer
    fitted on nothing would hold only its special tokens."""
    read = []
    for text in texts:
        read.append(text)
        if text:
            return itertools.chain(read, texts)
    held = f"{len(read)} text{'s' * (len(read) > 1)}, every one empty" if read else "no texts"
    raise InputError(f"texts hold no text to train on ({held}): give the tokenizer some text, e.g. the training "
                     "split's documents")  # fmt: skip


def _each_string(texts: Iterable) -> Iterator[str]:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputError(f"texts[{i}] is {given(text)}: texts must be strings")
        yield text


def tokenizer_record(tokenizer: Tokenizer, folder: str | Path) -> dict:
    """What a run records of the tokenizer it saved into `folder` (in each checkpoint's trainer.json), so that a
    tokenizer/ folder swapped for another one is recognised when the run is loaded: name, vocab_size, eot_id and
    the sha256 of every file in the folder (tokenizer_problem checks them)."""
    files = {p.name: sha256_file(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name[0] != "."}
    return {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id, "files": files}


def tokenizer_copy_problem(tokenizer: Tokenizer, source: str | Path, copy: str | Path) -> str | None:
    """Why a run must not save `tokenizer` (loaded from the prepared folder `source`) over its own tokenizer/ folder
    `copy`, or None: a file the save would write is there already with another sha256 (the run's first steps were
    trained with that one; a resume or a rerun over the run's folder). A file not there yet is no difference."""
    copy = Path(copy)
    if not copy.is_dir():
        return None
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save(scratch)  # what the run would write, byte for byte
        for made in sorted(Path(scratch).iterdir()):
            kept = copy / made.name
            if not kept.is_file():
                continue
            new, old = sha256_file(made), sha256_file(kept)
            if new != old:
                theirs = Path(source) / made.name
                return (f"{theirs}: the prepared tokenizer differs from the run's own copy {kept} (sha256 "
                        f"{new[:12]}... vs {old[:12]}...), which the run was trained with: restore the prepared data "
                        f"(or delete {source} to prepare it again from the source), or start the run again in a new "
                        "--out")  # fmt: skip
    return None


def tokenizer_problem(record: dict, tokenizer: Tokenizer, folder: str | Path) -> str | None:
    """Why `tokenizer`, loaded from `folder`, is not the one `record` (tokenizer_record, when the run was trained)
    describes, or None. Files added to the folder since are not looked at; a recorded file changed or gone is."""
    for key in ("vocab_size", "eot_id"):
        if key in record and getattr(tokenizer, key) != record[key]:
            return f"the tokenizer's {key} is {getattr(tokenizer, key)}, the run was trained with {record[key]!r}"
    files = record.get("files")
    for name, digest in files.items() if isinstance(files, dict) else ():
        path = Path(folder) / str(name)
        if not path.is_file():
            return f"{name} is missing (the run was trained with one)"
        found = sha256_file(path)
        if found != digest:
            return (f"{name} is not the file the run was trained with (sha256 {found[:12]}..., recorded "
                    f"{str(digest)[:12]}...)")  # fmt: skip
    return None


def load_tokenizer(
    name: str, folder: str | Path | None = None, *, data_dir: str | Path | None = None, download: bool | None = None
) -> Tokenizer:
    """The tokenizer `name`, from a prepared folder when given (fitted kinds and model references need one: a
    model's tokenizer is read from the model by attnlab.interop, then saved in the folders made with it).

    gpt2 comes from `folder/gpt2.tiktoken`, else the GPT-2 BPE files in a data directory
    (`gpt2-bpe/encoder.json` + `vocab.bpe`, or `gpt2-bpe/r50k_base.tiktoken`), else tiktoken's download
    when downloads are allowed.
    """
    if not isinstance(name, str):
        raise InputError(f"tokenizer name must be a str ({', '.join(KINDS)}, or a model reference), got {given(name)}")
    check_tokenizer_name(name)
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        saved = Path(folder) / TiktokenTokenizer.file if folder else None
        if saved is not None and saved.exists():
            return TiktokenTokenizer(_read_tiktoken_file(saved))
        return TiktokenTokenizer(_gpt2_ranks(data_dir, download))
    if names_model(name):
        if folder is None:
            raise DataError(f"tokenizer {name!r} is a model's: load the model (attnlab.interop.load_model), or read "
                            "it from a folder made with it")  # fmt: skip
        from attnlab.data.pretrained import tokenizer_from_folder  # imports this module

        return tokenizer_from_folder(folder, name=name)
    if folder is None:
        raise DataError(f"tokenizer {name!r} is fitted to a dataset: load it from its prepared folder (prepare())")
    cls = {"word": WordTokenizer, "char": CharTokenizer}.get(name, BPETokenizer)
    path = Path(folder) / cls.file
    fix = f"restore it from a copy, or delete {folder} to make it again from the data"
    if not path.exists():
        raise DataError(f"{path}: missing (the tokenizer folder is incomplete); {fix}")
    try:
        if cls is BPETokenizer:
            return BPETokenizer(name, HFTokenizer.from_file(str(path)))
        data = loads_json(path.read_text(encoding="utf-8"))
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
            raise DataError('expected {"tokens": [text, ...]}')
        return cls(tokens)
    except OSError:  # permissions, a disk error: the operating system's own message names the file
        raise
    except Exception as e:  # json, a bad vocabulary (DataError), the tokenizers library's plain Exception
        detail = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"{path}: not a valid {name} tokenizer file ({detail}): it was damaged; {fix}") from None


# ----------------------------------------------------------------------------- GPT-2 BPE files


def _checked_bytes(path: Path, expected_as: str) -> bytes:
    """The file's bytes, after checking their sha256 against GPT-2's file named `expected_as`."""
    data = path.read_bytes()
    digest, expected = hashlib.sha256(data).hexdigest(), GPT2_SHA256[expected_as]
    if digest != expected:
        raise DataError(
            f"{path} has sha256 {digest[:16]}..., not that of GPT-2's {expected_as} ({expected[:16]}...): "
            "the file is corrupt or from another tokenizer; replace it (or delete the prepared folder holding it)"
        )
    return data


def _read_tiktoken_file(path: Path) -> dict[bytes, int]:
    data = _checked_bytes(path, "r50k_base.tiktoken")
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode` table inverted: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _ranks_from_encoder_json(encoder_json: Path, vocab_bpe: Path) -> dict[bytes, int]:
    """tiktoken's mergeable ranks are GPT-2's encoder.json ids; vocab.bpe (the merges) is checked by hash."""
    encoder = loads_json(_checked_bytes(encoder_json, "encoder.json"))
    _checked_bytes(vocab_bpe, "vocab.bpe")
    byte_of = _gpt2_byte_decoder()
    return {bytes(byte_of[c] for c in token): rank for token, rank in encoder.items() if token != EOT}


def _gpt2_ranks(data_dir: str | Path | None, download: bool | None) -> dict[bytes, int]:
    tried = []
    for directory in data_dirs(data_dir):
        folder = directory / "gpt2-bpe"
        tried.append(str(folder))
        if (folder / "encoder.json").exists() and (folder / "vocab.bpe").exists():
            return _ranks_from_encoder_json(folder / "encoder.json", folder / "vocab.bpe")
        if (folder / "r50k_base.tiktoken").exists():
            return _read_tiktoken_file(folder / "r50k_base.tiktoken")
    where = f"looked for gpt2-bpe/encoder.json + vocab.bpe or gpt2-bpe/r50k_base.tiktoken in: {', '.join(tried)}"
    if not downloads_allowed(download):
        raise DataError(
            f"GPT-2 BPE files not found ({where}); downloads are off. Pass --data-dir DIR or set "
            "ATTNLAB_DATA to a directory holding gpt2-bpe/, or allow downloads (unset ATTNLAB_OFFLINE)"
        )
    try:
        return load_tiktoken_bpe(GPT2_URL, expected_hash=GPT2_SHA256["r50k_base.tiktoken"])
    except Exception as e:  # requests/urllib/hash errors: report them with what to do
        raise DataError(
            f"GPT-2 BPE files not found ({where}) and the download from {GPT2_URL} failed ({e}); "
            "put encoder.json + vocab.bpe in <data dir>/gpt2-bpe/"
        ) from None
