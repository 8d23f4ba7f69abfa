"""A pretrained model's tokenizer (tokenizer.json, via the `tokenizers` library) as an attnlab Tokenizer.

    tokenizer = tokenizer_from_folder("path/to/hf-folder")     # tokenizer.json (+ tokenizer_config.json)
    tokenizer.save(folder)                                    # the same two files, which tokenizer_from_folder reads
    tokenizer.fingerprint                                     # sha256 of what decides its ids (prepared data's key)

It lives with the data pipeline so that prepared token files can be made with, and reloaded with, a pretrained
model's tokenizer (`data.tokenizer: <model reference>`); attnlab.interop builds it from GGUF metadata too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from attnlab.data.files import atomic_write_text, file_kind, unreachable
from attnlab.data.tokenizers import Tokenizer, checked_ids, checked_text, checked_texts
from attnlab.errors import DataError, InputError
from attnlab.jsonio import DuplicateKey, loads_json

# The ids a document ends with in pretraining, when the vocabulary has one (GPT-2 family, SmolLM, Llama 3);
# otherwise end-of-text is the end-of-sequence id.
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")


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
        template_source: str | None = None,
        source: str | None = None,
        eos_fix: str = "",
    ):
        self.name = name
        self.template_source = template_source or name  # the file the chat template was read from, for its errors
        self.tokenizer = tokenizer
        self.tokenizer.encode_special_tokens = True  # ordinary text: "<|endoftext|>" inside it is plain text
        self._prompt_tokenizer: HFTokenizer | None = None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_ids[0] if eos_ids else None
        end_of_text = [tokenizer.token_to_id(t) for t in END_OF_TEXT_TOKENS if tokenizer.token_to_id(t) is not None]
        eot_id = end_of_text[0] if end_of_text else self.eos_id
        if eot_id is None:
            raise DataError(f"{source or name}: the tokenizer has no end-of-sequence token, which attnlab needs to end "
                            f"a generation and to separate documents{'; ' + eos_fix if eos_fix else ''}")  # fmt: skip
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
            raise InputError(f"{self.template_source}: the model has no chat template (leave out --chat)")
        import jinja2  # a dependency of torch; imported here only: chat prompts alone need it
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise InputError(f"{self.template_source}: the chat template refuses the prompt: {message}")

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
            raise DataError(f"{self.template_source}: its chat template does not render ({' '.join(str(e).split())})"
                            ) from None  # fmt: skip
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
            return self.tokenizer.encode(checked_text(text), add_special_tokens=False).ids
        ids = self.prompt_tokenizer.encode(checked_text(text), add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(checked_texts(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(checked_ids(ids), skip_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        """16 hex digits of sha256 over what decides the ids of a prepared token file: tokenizer.json and the id put
        between documents."""
        blob = self.tokenizer.to_str() + json.dumps({"eot_id": self.eot_id})
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    files = ("tokenizer.json", "tokenizer_config.json")  # what save writes

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


def regular_file(path: str | Path, fix: str = "put the file itself there") -> bool:
    """Whether `path` is a regular file (a symbolic link is followed): False when nothing is there (or a link points
    nowhere); DataError (one line saying what it is) when something else is: a folder, or a FIFO, socket or device,
    which reading would block on forever or fail on (`fix` says what to do). A file that cannot be read
    (permissions) is still a regular file: reading it raises the PermissionError that names it."""
    try:
        kind = file_kind(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR) and not os.path.islink(path):
            return False
        problem = unreachable(path)  # a link to nothing or a link loop: not "not found" (ls shows it)
        if problem is None:
            raise  # (permissions: the command's line for the operating system's refusals names it)
        raise DataError(f"{path}: {problem}") from None
    if kind is None:
        return True
    raise DataError(f"{path}: is {kind}, where a file is expected ({fix})")


def _read_json(path: Path) -> dict:
    if not regular_file(path):
        return {}
    try:
        data = loads_json(path.read_text(encoding="utf-8"), unique_keys=True)
    except DuplicateKey as e:  # (json.loads, and transformers, would keep the last value silently)
        raise DataError(f"{path}: {e}") from None
    except PermissionError:  # not a damaged file: the OS's error names it
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):  # read as {}, its settings (BOS, the stop ids) would be lost without a word
        kind = "an array" if isinstance(data, list) else "null" if data is None else f"a {type(data).__name__}"
        raise DataError(f"{path}: {kind}, not a JSON object of settings (restore the model's own {path.name}, or "
                        "remove the file)")  # fmt: skip
    return data


def _read_text(path: Path, what: str) -> str:
    """The UTF-8 text of `path`; DataError naming it when it is not UTF-8 (OSErrors, e.g. permissions, name it)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}), so not {what}; save it as UTF-8, or "
                        "get the file again") from None  # fmt: skip


def _token_id(tokenizer: HFTokenizer, token: Any) -> int | None:
    """The id of a tokenizer_config.json special token: a string, or {"content": string}."""
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def check_settings(path: Path, settings: dict, tokenizer: HFTokenizer) -> None:
    """DataError (one line naming the file and key) for a tokenizer_config.json setting read here that is of the
    wrong type (add_bos_token "false", a string, would be read as true) or a bos_token / eos_token the tokenizer has
    no id for (it would be dropped without a word: no BOS, or no stop at the end of a turn)."""
    for key in ("add_bos_token", "add_eos_token"):
        value = settings.get(key)
        if value is not None and not isinstance(value, bool):
            raise DataError(f"{path}: {key}={json.dumps(value)[:60]} is not true or false (JSON booleans, unquoted): "
                            "fix it, or remove the key")  # fmt: skip
    for key in ("bos_token", "eos_token"):
        value = settings.get(key)
        token = value.get("content") if isinstance(value, dict) else value
        if value is None:
            continue
        if not isinstance(token, str):
            raise DataError(f"{path}: {key}={json.dumps(value)[:60]} is not a token (a string, or an object with a "
                            '"content" string): fix it, or remove the key')  # fmt: skip
        if tokenizer.token_to_id(token) is None:
            raise DataError(f"{path}: {key}={token!r} is not a token of tokenizer.json (the two files are of "
                            "different models, or one was changed): give a token of its vocabulary, or remove the "
                            "key")  # fmt: skip


def _ids(value: Any) -> list[int]:
    """A bos_token_id or eos_token_id (checked by special_ids) as a list of ids."""
    return value if isinstance(value, list) else [] if value is None else [value]


def special_ids(folder: Path, tokenizer: HFTokenizer) -> dict:
    """config.json's keys with generation_config.json's over them. DataError naming the file and key when either
    gives a bos_token_id or eos_token_id (an id or a list of ids) that is no id of the tokenizer: a bool (true would
    be id 1), a negative id or one past the vocabulary, which generation would stop at never, or at an ordinary
    token."""
    size, merged = tokenizer.get_vocab_size(with_added_tokens=True), {}
    for file in ("config.json", "generation_config.json"):
        data = _read_json(folder / file)
        merged.update(data)
        for key in ("bos_token_id", "eos_token_id"):
            value = data.get(key)
            values = _ids(value)
            if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < size for v in values):
                raise DataError(f"{folder / file}: {key}={json.dumps(value)[:60]} is not a token id of the tokenizer "
                                f"(ids 0 .. {size - 1}): give the id (or a list of ids) of the model's special token, "
                                "or remove the key")  # fmt: skip
    return merged


def tokenizer_from_folder(folder: str | Path, name: str | None = None) -> PretrainedTokenizer:
    """The tokenizer of a Hugging Face model folder: tokenizer.json, with the special tokens, add_bos_token and
    chat template of tokenizer_config.json (else config.json's ids, and whether tokenizer.json adds BOS)."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not regular_file(path):
        raise DataError(f"{path}: not found (the model folder needs its tokenizer.json)")
    # Read here, not by the tokenizers library: an unreadable file raises the PermissionError naming it (the library
    # would call it invalid).
    text = _read_text(path, "a valid tokenizer.json")
    try:
        tokenizer = HFTokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise DataError(f"{path}: not a valid tokenizer.json ({' '.join(str(e).split())})") from None
    check_vocab_ids(tokenizer, path)
    settings = _read_json(folder / "tokenizer_config.json")
    check_settings(folder / "tokenizer_config.json", settings, tokenizer)
    config = special_ids(folder, tokenizer)
    bos_id = _token_id(tokenizer, settings.get("bos_token"))
    bos_id = bos_id if bos_id is not None else next(iter(_ids(config.get("bos_token_id"))), None)
    eos = _token_id(tokenizer, settings.get("eos_token"))
    eos_ids = list(dict.fromkeys(([eos] if eos is not None else []) + _ids(config.get("eos_token_id"))))
    add_bos = settings.get("add_bos_token")
    if add_bos is None:  # does tokenizer.json's post-processor put BOS first?
        with_specials = tokenizer.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and with_specials[:1] == [bos_id]
    template = settings.get("chat_template")
    named = isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str)
                                               for t in template)  # fmt: skip
    if template is not None and not (isinstance(template, str) or named):
        raise DataError(f"{folder / 'tokenizer_config.json'}: chat_template={json.dumps(template)[:60]} is neither a "
                        'Jinja template string nor a list of {"name": ..., "template": "..."} objects (fix it, or '
                        "remove the key to use the model without a chat template)")  # fmt: skip
    if named:  # named templates: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja, template_source = folder / "chat_template.jinja", folder / "tokenizer_config.json"
    if template is None and regular_file(jinja):
        template, template_source = _read_text(jinja, "a Jinja chat template"), jinja
    return PretrainedTokenizer(
        name or f"hf:{folder.name}", tokenizer, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos,
        chat_template=template, template_source=str(template_source if template is not None else folder),
        source=str(folder), eos_fix="name it as eos_token in tokenizer_config.json",
    )  # fmt: skip


def check_token_ids(tokenizer: PretrainedTokenizer, vocab_size: int, source: str | Path) -> None:
    """DataError (one line naming `source`, the first such token and the vocabulary size) when the tokenizer has an id
    the model has no embedding row for: an id >= vocab_size (an added token past the vocabulary, a tokenizer of
    another model). A model may have more rows than its tokenizer has ids (vocabularies padded for speed)."""
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    past = sorted((i, token) for token, i in vocab.items() if i >= vocab_size)
    if past:
        (first, token), more = past[0], f" and {len(past) - 1} more" if len(past) > 1 else ""
        raise DataError(f"{source}: token {token!r} has id {first}{more}, but the model has {vocab_size} "
                        f"embedding rows (vocab_size={vocab_size}, ids 0 .. {vocab_size - 1}): the tokenizer is not "
                        "this model's, or was changed (use the model's own tokenizer)")  # fmt: skip


def check_vocab_ids(tokenizer: HFTokenizer, path: Path) -> None:
    """DataError (one line naming tokenizer.json, the id and both tokens) when its model's vocab maps two tokens to
    one id: decoding that id gives one of them, so the other could never be read back (an added token given an id
    already taken is moved past the vocabulary, which check_token_ids refuses)."""
    seen: dict[int, str] = {}
    for token, i in sorted(tokenizer.get_vocab(with_added_tokens=False).items(), key=lambda item: (item[1], item[0])):
        if i in seen:
            raise DataError(f"{path}: the tokens {seen[i]!r} and {token!r} both have id {i} in model.vocab: one of "
                            "them could never be decoded: the file is damaged or was edited (use the model's own "
                            "tokenizer.json)")  # fmt: skip
        seen[i] = token
