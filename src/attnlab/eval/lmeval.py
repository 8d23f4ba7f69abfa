"""lm-evaluation-harness (lm-eval 0.4.13, the `lmeval` extra) over attnlab models: `AttnlabLM` and `run_lm_eval`.

    results = run_lm_eval("runs/x/seed0", ["arc_easy_local"], include_path="my_tasks", limit=100)
    results["results"]["arc_easy_local"]["acc,none"]

`AttnlabLM` is an lm-eval `TemplateLM` over an attnlab EvalModel (any model reference: an attnlab run, a .gguf
file, a Hugging Face folder, hf:ORG/NAME), scored the way lm-eval's own Hugging Face model (`HFLM`,
lm_eval/models/huggingface.py) scores, so that the numbers can be set beside published lm-eval numbers:

* Encoding (`TemplateLM._encode_pair`, inherited): trailing white space of a context moves to the front of the
  continuation; the continuation's ids are `encode(context + continuation)[len(encode(context)):]`. `tok_encode`
  puts BOS first when the model's tokenizer does so for a prompt (`add_bos`, as HFLM follows the tokenizer's
  default) unless `add_bos_token` says otherwise, and never twice: a string that starts with the BOS text gets
  the BOS id in its place. Other special-token text in a string stays plain text (attnlab's `encode`).
* The prefix of an empty context and of rolling windows (`prefix_token_id`): the model's BOS id when its
  tokenizer has one (HFLM), else end-of-text (`eot_id`, what attnlab puts between training documents).
* loglikelihood (`_loglikelihood_tokens`): the model reads `(context + continuation)[-(max_length + 1):][:-1]`
  (a long context is cut on the left) and the continuation's log-probs are the last len(continuation)
  positions, log-softmax in fp32; is_greedy = every continuation token is the argmax.
* loglikelihood_rolling: lm-eval's `get_rolling_token_windows(tokens, prefix, max_length, context_len=1)` made
  disjoint: windows of max_length tokens predicting each token once, the first window after the prefix token,
  the last one with a full max_length of context (it overlaps the one before and scores only its new tokens).
  As in HFLM, the string is encoded with `tok_encode` (so a tokenizer that adds BOS scores BOS after the prefix).
* generate_until: greedy unless do_sample (temperature, top_k, top_p); the context cut on the left to
  max_length - max_gen_toks; generation stops at the model's stop ids (dropped from the text) or once the text
  holds an `until` string (the text is cut before it, lm-eval's postprocess_generated_text).

A model with a bounded memory (cfg.memory) reads every sequence through its memory as it is. `kv_policy` (e.g.
"k=q8_0,v=q4_0,resid=128") stores the KV cache quantized, and the text is read as `generate` reads it: the
context in one prefill, then the continuation one token at a time, each query seeing the earlier tokens as the
cache stores them (so a continuation `generate` chose greedily under the policy scores is_greedy under it);
generate_until decodes through the same cache. Without a policy, a batch is one forward pass (no cache).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
from pathlib import Path

import torch

from attnlab.accounting import kv_report
from attnlab.cache.codecs import as_policy
from attnlab.data.files import atomic_write_text, downloads_allowed, folder_lock
from attnlab.data.pretrained import PretrainedTokenizer
from attnlab.errors import AttnlabError, ConfigError, DataError, InputError
from attnlab.eval.lmeval_task_files import check_duplicate_tasks, check_task_files
from attnlab.eval.lmeval_tasks import (
    attach,
    build_tasks,
    leaf_tasks,
    offline_line,
    task_file,
    task_manager,
    task_specs,
)
from attnlab.eval.loading import EvalModel, check_weights_choice, load_for_eval
from attnlab.eval.records import records_in_run_problem
from attnlab.generate import check_sampling, decode_step, prefill, refuse_nan_logits, sample
from attnlab.interop.references import HUB_PREFIX, model_config_of, parse_hub_ref, resolve

try:
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.api.model import TemplateLM
    from lm_eval.loggers.utils import get_commit_from_path
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, handle_non_serializable, make_disjoint_window, make_table
except ImportError as e:  # an optional extra: the core never imports this module
    raise ConfigError(
        f"lm-evaluation-harness is not installed ({e}): pip install 'attnlab[lmeval]' (lm-eval==0.4.13)"
    ) from None

PREFILL_CHUNK = 512  # generate()'s default prefill_chunk: a quantized cache is filled as generation fills it
GENERATION_KEYS = ("do_sample", "temperature", "top_k", "top_p")  # what generate_until understands besides until


class AttnlabLM(TemplateLM):
    """An lm-eval language model over an attnlab EvalModel (see the module docstring for how it scores).

    kv_policy: a KVPolicy or a string ("k=q8_0,v=q4_0,resid=128"), None = the model's own cache dtype.
    max_length: the window in tokens (default cfg.max_seq_len; more only for a model with a bounded memory).
    add_bos_token: None = as the tokenizer does for a prompt, True / False = always / never.
    prefix_token_id: overrides the prefix of empty contexts and rolling windows.
    seed: seeds sampling in generate_until (None: torch's global generator, which simple_evaluate seeds).
    """

    def __init__(
        self,
        model: EvalModel,
        kv_policy=None,
        batch_size: int = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        seed: int | None = None,
    ):
        super().__init__()
        if model.tokenizer is None:
            raise DataError(f"{model.path}: no tokenizer is known for this model; lm-eval scores text")
        cfg = model.model.cfg
        streams = cfg.memory.kind != "none"
        max_length = cfg.max_seq_len if max_length is None else max_length
        problems = []
        if not isinstance(batch_size, int) or batch_size < 1:
            problems.append(f"batch_size={batch_size!r} must be a whole number >= 1")
        if not isinstance(max_length, int) or max_length < 2:
            problems.append(f"max_length={max_length!r} must be a whole number >= 2")
        elif max_length > cfg.max_seq_len and not streams:
            problems.append(f"max_length={max_length} exceeds the model's max_seq_len={cfg.max_seq_len} (only a model "
                            "with a bounded memory reads longer sequences)")  # fmt: skip
        if not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            problems.append(f"max_gen_toks={max_gen_toks!r} must be a whole number >= 1")
        if problems:
            raise ConfigError(problems)
        self.eval_model, self.model, self.tokenizer = model, model.model, model.tokenizer
        self.kv_policy = as_policy(kv_policy)
        self._batch_size, self._max_length, self._max_gen_toks = batch_size, max_length, max_gen_toks
        bos_id = model.tokenizer.bos_id if isinstance(model.tokenizer, PretrainedTokenizer) else None
        self.bos_id = bos_id
        # The ids a prompt starts with (BOS for a tokenizer that adds one), as the tokenizer encodes one.
        self.add_bos_token = add_bos_token if add_bos_token is not None else bool(model.tokenizer.encode_prompt(""))
        if self.add_bos_token and bos_id is None:
            raise ConfigError(f"add_bos_token=True, but the tokenizer of {model.name} has no BOS token")
        self._prefix_token_id = prefix_token_id if prefix_token_id is not None else (
            bos_id if bos_id is not None else model.tokenizer.eot_id
        )  # fmt: skip
        check_sampling(seed=seed)
        self.seed = seed
        self.task_files: dict[str, str] = {}  # task name -> its YAML file, to name it in an error (run_lm_eval)
        self._instances = None  # the loglikelihood requests being scored, to name a task and item in an error

    # ------------------------------------------------------------------------- what lm-eval reads

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self.eval_model.device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def get_model_info(self) -> dict:
        """Added to results["config"] by simple_evaluate."""
        return {
            "model_name": self.eval_model.name, "model_source": str(self.eval_model.path),
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(next(self.model.parameters()).dtype), "max_length": self.max_length,
            "kv_policy": None if self.kv_policy is None else str(self.kv_policy), "tokenizer": self.tokenizer.name,
        }  # fmt: skip

    # ------------------------------------------------------------------------- tokens

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string`, BOS first when add_special_tokens (None: add_bos_token) asks for it; a string
        that starts with the BOS text (and add_special_tokens None) gets the BOS id for it, never a second BOS."""
        if add_special_tokens is None and self.bos_id is not None:
            bos_text = self.tokenizer.decode([self.bos_id])
            if bos_text and string.startswith(bos_text):
                return [self.bos_id, *self.tokenizer.encode(string[len(bos_text) :])]
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        ids = self.tokenizer.encode(string)
        return [self.bos_id, *ids] if bos and self.bos_id is not None else ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------------- scoring

    @torch.no_grad()
    def _logits(self, tokens: torch.Tensor, context_len: int) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V). With a KV policy, as generation reads them through the quantized
        cache: the first `context_len` tokens in one prefill (in chunks of PREFILL_CHUNK, as `generate`), the
        rest one at a time."""
        if self.kv_policy is None:
            return self.model(tokens, use_cache=False)[0]
        cache = self.model.new_cache(tokens.shape[0], tokens.shape[1], policy=self.kv_policy)
        logits = [self.model(tokens[:, s : min(s + PREFILL_CHUNK, context_len)], cache=cache)[0]
                  for s in range(0, context_len, PREFILL_CHUNK)]  # fmt: skip
        logits += [self.model(tokens[:, t : t + 1], cache=cache)[0] for t in range(context_len, tokens.shape[1])]
        return torch.cat(logits, dim=1)

    def _batches(self, windows: list[list[int]], context_lens: list[int]) -> list[list[int]]:
        """Request indices in batches of up to batch_size, longest first (HFLM's order: a batch's first row sets its
        padded length). With a KV policy, a batch's rows share their context length (all prefilled at once)."""
        order = sorted(range(len(windows)), key=lambda i: (-len(windows[i]), tuple(windows[i])))
        if self.kv_policy is not None:
            order.sort(key=lambda i: context_lens[i])  # stable: longest first within a context length
        batches: list[list[int]] = []
        for i in order:
            same = self.kv_policy is None or (batches and context_lens[batches[-1][0]] == context_lens[i])
            if batches and len(batches[-1]) < self.batch_size and same:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's (the pairs encoded, then _loglikelihood_tokens), the Instances kept to name an item. No
        "Tokenizing inputs" bar: it is over at once, and would stand before an error's one line."""
        self._instances = requests
        try:
            return super().loglikelihood(requests, disable_tqdm=True)
        finally:
            self._instances = None

    def _too_long(self, i: int, n: int) -> InputError:
        """The error for request i, whose continuation of n tokens cannot be read within max_length: naming its
        task file and item when lm-eval's Instances are known."""
        where = ""
        if self._instances is not None and i < len(self._instances):
            instance = self._instances[i]
            name = instance.task_name
            where = f"{self.task_files.get(name, name)}: item {instance.doc_id}: "
        longer = (
            " (or a larger max_length: the model has a bounded memory)" if self.model.cfg.memory.kind != "none" else ""
        )
        fix = f"evaluate the task with a model of longer max_seq_len{longer}"
        return InputError(f"{where}a continuation of {n} tokens exceeds max_length={self.max_length}: {fix}")

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(summed log p(continuation | context), is_greedy) per (cache key, context ids, continuation ids)."""
        windows, n_cont = [], []
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise InputError("a loglikelihood request needs at least one context and one continuation token")
            if len(continuation) > self.max_length:
                raise self._too_long(i, len(continuation))
            windows.append((context + continuation)[-(self.max_length + 1) :])  # the last token is only a target
            n_cont.append(len(continuation))
        # The model reads window[:-1]; the logits of its positions context_len - 1 .. end score the continuation.
        context_lens = [len(window) - n for window, n in zip(windows, n_cont, strict=True)]
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        device = self.device
        for batch in self._batches(windows, context_lens):
            tokens = torch.zeros(len(batch), max(len(windows[i]) for i in batch) - 1, dtype=torch.long)  # (B, T)
            for row, i in enumerate(batch):  # right-padded: padding after a row never changes its logits (causal)
                tokens[row, : len(windows[i]) - 1] = torch.tensor(windows[i][:-1])
            logits = self._logits(tokens.to(device), context_lens[batch[0]])  # (B, T, V)
            refuse_nan_logits(self.model, logits, "on a loglikelihood request")
            for row, i in enumerate(batch):
                n_in = len(windows[i]) - 1
                targets = torch.tensor(windows[i][-n_cont[i] :], device=device)
                logprobs = logits[row, n_in - n_cont[i] : n_in].float().log_softmax(dim=-1)  # (n_cont, V)
                greedy = bool((logprobs.argmax(dim=-1) == targets).all())
                out[i] = (float(logprobs.gather(-1, targets[:, None]).sum()), greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood of each string, every token predicted once (see the module docstring)."""
        spans, windows = [], []
        for (string,) in [request.args for request in requests]:
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            start = len(windows)
            windows.extend((None, *make_disjoint_window(window)) for window in rolling)
            spans.append((string, start, len(windows)))
        scores = self._loglikelihood_tokens(windows)
        totals = []
        for string, start, end in spans:
            totals.append(sum(score for score, _ in scores[start:end]))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), totals[-1])
        return totals

    # ------------------------------------------------------------------------- generation

    def _sampling(self, gen_kwargs: dict) -> tuple[list[str], int, dict]:
        """(until strings, max_gen_toks, sample() arguments) from a request's generation kwargs."""
        if not isinstance(gen_kwargs, dict):
            raise ConfigError(f"generation kwargs must be a mapping, got {gen_kwargs!r}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]))
        max_gen_toks = kwargs.pop("max_gen_toks")
        unknown = sorted(set(kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise ConfigError(f"generation kwargs {', '.join(unknown)} are not supported by attnlab's generate_until "
                              f"(it takes until, max_gen_toks, {', '.join(GENERATION_KEYS)})")  # fmt: skip
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
        check_sampling(max_gen_toks, temperature, top_k, top_p)
        if max_gen_toks >= self.max_length:
            raise InputError(f"max_gen_toks={max_gen_toks} leaves no room for a context: max_length={self.max_length}")
        return until, max_gen_toks, {"temperature": temperature, "top_k": top_k, "top_p": top_p}

    @torch.no_grad()
    def _generate(self, context: list[int], max_gen_toks: int, until: list[str], sampling: dict, generator) -> str:
        """The continuation of `context` as text, cut before the first `until` string."""
        stop_ids = set(self.tokenizer.stop_ids)
        tokens = torch.tensor([context], dtype=torch.long, device=self.device)  # (1, T)
        policy = {} if self.kv_policy is None else {"policy": self.kv_policy}
        cache = self.model.new_cache(1, len(context) + max_gen_toks, **policy)
        logits = prefill(self.model, tokens, cache)  # (1, V)
        new: list[int] = []
        for step in range(max_gen_toks):
            token = sample(logits, generator=generator, **sampling)  # (1, 1)
            if int(token) in stop_ids:  # an end of text is not text (HFLM decodes with skip_special_tokens)
                break
            new.append(int(token))
            if any(stop and stop in self.tok_decode(new) for stop in until):
                break
            if step + 1 < max_gen_toks:
                logits = decode_step(self.model, token, cache)
        return postprocess_generated_text(self.tok_decode(new), stop=until, think_end_token=None)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """One continuation per (context, generation kwargs) request, one request at a time."""
        generator = None if self.seed is None else torch.Generator(device=self.device).manual_seed(self.seed)
        out = []
        for context, gen_kwargs in [request.args for request in requests]:
            until, max_gen_toks, sampling = self._sampling(gen_kwargs)
            ids = self.tok_encode(context)[-(self.max_length - max_gen_toks) :]  # cut on the left, as HFLM
            if not ids:
                ids = [self.prefix_token_id]
            out.append(self._generate(ids, max_gen_toks, until, sampling, generator))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), out[-1])
        return out


# ----------------------------------------------------------------------------- tasks and runs


def table(results: dict) -> str:
    """lm-eval's own markdown table of the results (and of the groups, when tasks were grouped)."""
    text = make_table(results)
    return text + ("\n" + make_table(results, "groups") if results.get("groups") else "")


RESULT_FILES = ("lm_eval.json", "lm_eval_samples.jsonl")


def write_results(out_dir: str | Path, results: dict) -> tuple[Path, Path]:
    """OUT/lm_eval.json (the results without the per-item samples) and OUT/lm_eval_samples.jsonl (one row per
    item and task: {"task", doc_id, doc, arguments, resps, filtered_resps, metrics...}), each written atomically."""
    out_dir = Path(out_dir)
    summary = {key: value for key, value in results.items() if key != "samples"}
    rows = [{"task": task, **row} for task, items in (results.get("samples") or {}).items() for row in items]
    dump = lambda obj, **kw: json.dumps(obj, default=handle_non_serializable, ensure_ascii=False, **kw)  # noqa: E731
    summary_path, samples_path = (out_dir / name for name in RESULT_FILES)
    # the items first and the results last: lm_eval.json is the mark of a finished evaluation, so a run killed
    # between the two leaves only an items file that the next evaluation into this folder replaces
    atomic_write_text(samples_path, "".join(dump(row) + "\n" for row in rows))
    atomic_write_text(summary_path, dump(summary, indent=1) + "\n")
    return summary_path, samples_path


def _git_commit_hash() -> str | None:
    """lm-eval's get_git_commit_hash (the working folder's git commit, which it records as results["git_hash"]) with
    git's own stderr dropped: outside a git repository `git describe` prints "fatal: not a git repository ..." to the
    terminal, a stray line that is no error of the evaluation (lm-eval then reads .git by hand, as this does)."""
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):  # not a repository, or no git on this machine
        return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def _quiet_git():
    """simple_evaluate with _git_commit_hash in place of lm-eval's own (restored on the way out)."""
    own = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = _git_commit_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = own


@contextlib.contextmanager
def _no_request_bar():
    """simple_evaluate without the "0/3 .. 3/3" bar of lm-eval's Task.build_all_requests (restored on the way out):
    every item was rendered already (build_tasks), so it is over at once, and it stood before an error's one line (a
    continuation too long for the model is found once the requests are scored)."""
    import lm_eval.api.task

    bar = lm_eval.api.task.tqdm
    lm_eval.api.task.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        lm_eval.api.task.tqdm = bar


@contextlib.contextmanager
def _hub_offline_if_asked():
    """With downloads off ($ATTNLAB_OFFLINE, as for every file attnlab reads), `datasets` and huggingface_hub do not
    reach for the Hub either: a Hub task then fails at once, not after five network retries (probe N's n6). Both
    libraries read their own variables at import, so their settings are switched here (restored on the way out)."""
    if downloads_allowed():
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    saved = (
        datasets.config.HF_HUB_OFFLINE,
        datasets.config.HF_DATASETS_OFFLINE,
        huggingface_hub.constants.HF_HUB_OFFLINE,
    )
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved[:2]
        huggingface_hub.constants.HF_HUB_OFFLINE = saved[2]


@contextlib.contextmanager
def _one_line(tasks: list[str], manager, num_fewshot: int | None):
    """lm-eval's own exceptions that are the user's to fix, as one typed error: a Hub dataset out of reach (offline),
    more few-shot examples than a task holds, task data `datasets` could not load."""
    try:
        yield
    except ConnectionError as e:  # a task whose data is on the Hugging Face Hub, offline: name it and the local task
        raise DataError(offline_line(tasks, manager, e)) from None
    except ValueError as e:
        if num_fewshot is None or "Sample larger than population" not in str(e):
            raise
        # random.sample of more few-shot examples than the task's few-shot split holds
        raise ConfigError(f"num_fewshot={num_fewshot:,} (--num-fewshot) is more few-shot examples than the "
                          f"few-shot split of {', '.join(map(repr, tasks))} holds (lm-eval draws them from the "
                          "task's fewshot, training or validation split, never the item itself): give fewer"
                          ) from None  # fmt: skip


def run_lm_eval(
    ref: str | Path | EvalModel,
    tasks: list[str],
    out_dir: str | Path | None = None,
    kv_policy=None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    data_dir: str | Path | None = None,
    include_path: str | Path | list | None = None,
    batch_size: int = 1,
    bootstrap_iters: int = 100000,
    weights: str = "fp32",
    activations: str = "fp32",
) -> dict:
    """lm-eval's `simple_evaluate` on a model reference (or a loaded EvalModel) through `AttnlabLM`: its results
    dict, per-item samples under results["samples"]. include_path: folders of task YAMLs besides lm-eval's own;
    a relative data file in one of them is looked up in the data directory (a group's members' too). Before the
    model is loaded the tasks are built and every item to evaluate rendered (lmeval_tasks.build_tasks): a task
    file's mistake is one ConfigError or DataError naming the file and key. out_dir: also write the results there
    (write_results); a folder that already holds them is refused, never overwritten. weights: how a reference's
    weights are held and activations: what their inputs are multiplied as (attnlab.eval.loading)."""
    if limit is not None and (isinstance(limit, bool) or not limit > 0 or (limit >= 1 and limit != int(limit))):
        raise ConfigError(f"limit={limit!r} must be a whole number >= 1 (or a fraction in (0, 1))")
    if num_fewshot is not None and (not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise ConfigError(f"num_fewshot={num_fewshot!r} must be a whole number >= 0")
    # Every local argument before the tasks are read, whose data may be on the Hub (offline: a minute of retries):
    # the KV policy, the batch, the weights, the folders and the model reference.
    kv_policy = as_policy(kv_policy)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a whole number >= 1")
    if not isinstance(ref, EvalModel):
        check_weights_choice(weights)
    paths = include_path if isinstance(include_path, list | tuple) else [include_path] if include_path else []
    for path in paths:
        if not Path(path).is_dir():
            raise ConfigError(f"include_path {path} is not a folder (give a folder of lm-eval task YAML files)")
    if out_dir is not None and Path(out_dir).exists() and not Path(out_dir).is_dir():  # before the evaluation
        raise ConfigError(f"--out {out_dir}: exists and is not a folder (give a folder for lm_eval.json)")
    problem = records_in_run_problem(out_dir, example="results/lm_eval") if out_dir is not None else None
    if problem:
        raise InputError(problem)
    _check_no_results(out_dir)
    if isinstance(ref, str) and ref.startswith(HUB_PREFIX):  # (the model itself is fetched when it loads)
        parse_hub_ref(ref)
    elif not isinstance(ref, EvalModel):  # a reference that names nothing (the model loads after the tasks)
        resolve(ref, data_dir)
    if kv_policy is not None and not (isinstance(ref, str) and ref.startswith(HUB_PREFIX)):
        check_policy_fits(ref, kv_policy, data_dir)
    broken = check_task_files([str(p) for p in paths])  # before lm-eval reads them (and imports !function code)
    check_duplicate_tasks([str(p) for p in paths], list(tasks))  # before lm-eval picks one of them by file order
    manager = attach(task_manager([str(p) for p in paths], list(tasks), broken), data_dir)
    names = task_specs(manager, list(tasks), data_dir, broken)  # checks the names before the model is loaded
    import datasets  # lm-eval's own dependency

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating validation split" bars would hide an error's one line
    held = contextlib.ExitStack()
    made = out_dir is not None and not Path(out_dir).exists()  # removed again if the evaluation fails
    if out_dir is not None:  # one evaluation at a time writes into out_dir: a second is refused now, not replaced later
        held.enter_context(folder_lock(out_dir, RESULTS_LOCK, lambda holder: _busy(out_dir, holder)))
        _check_no_results(out_dir)  # (one that ended while this one loaded its tasks)
    try:
        with _one_line(tasks, manager, num_fewshot), _hub_offline_if_asked():
            built = build_tasks(manager, names, limit, num_fewshot)  # the task files and items, before the model loads
        model = (
            ref
            if isinstance(ref, EvalModel)
            else load_for_eval(ref, data_dir=data_dir, weights=weights, activations=activations)
        )
        lm = AttnlabLM(model, kv_policy=kv_policy, batch_size=batch_size)
        lm.task_files = {task.task_name: task_file(manager, task.task_name) for task in leaf_tasks(built)}
        for task in leaf_tasks(built):  # a generation setting this model cannot follow, before lm-eval starts
            if task.config.output_type == "generate_until":
                try:
                    lm._sampling(dict(task.config.generation_kwargs or {}))
                except (ConfigError, InputError) as e:
                    raise ConfigError(f"generation_kwargs: {e}", source=lm.task_files[task.task_name]) from None
        with _one_line(tasks, manager, num_fewshot), _quiet_git(), _no_request_bar():  # no git "fatal:" line, no bar
            results = lm_eval.simple_evaluate(
                model=lm, tasks=built, num_fewshot=num_fewshot, limit=limit, task_manager=manager, log_samples=True,
                bootstrap_iters=bootstrap_iters, batch_size=batch_size,
            )  # fmt: skip
        results["config"]["model"] = str(model.path) if not isinstance(ref, EvalModel) else model.name
        if out_dir is not None:
            write_results(out_dir, results)
    except BaseException:
        if made:  # the folder this evaluation made for its results holds nothing of the user's: not left behind
            with contextlib.suppress(OSError):
                (Path(out_dir) / RESULTS_LOCK).unlink()
                Path(out_dir).rmdir()
        raise
    finally:
        held.close()
        if bars:
            datasets.enable_progress_bars()
    return results


def check_policy_fits(ref, kv_policy, data_dir) -> None:
    """A KV policy this model's cache cannot take (a KIVI group, a tensor it does not cache), said before the tasks
    are read (a minute or more) rather than once the model has loaded. A config that cannot be read is left to the
    model's loading to say."""
    try:
        cfg = ref.model.cfg if isinstance(ref, EvalModel) else model_config_of(ref, data_dir)
    except AttnlabError:
        return
    kv_report(cfg, "fp16", cfg.max_seq_len, kv_policy)


RESULTS_LOCK = ".lm_eval.lock"  # in an --out folder: held (flock) while an evaluation will write its results there


def _busy(out_dir, holder: str) -> str:
    return (f"--out {out_dir}: another attnlab lm-eval{holder} is evaluating into this folder (one would replace the "
            "other's results): wait for it to finish, or give another --out")  # fmt: skip


def _check_no_results(out_dir) -> None:
    """ConfigError when out_dir holds an earlier evaluation's results (its lm_eval.json, written last): they are
    never replaced. An items file alone is what an evaluation killed while writing left; the next one replaces it."""
    for name in RESULT_FILES[:1] if out_dir is not None else ():
        if (Path(out_dir) / name).exists():
            raise ConfigError(f"--out {out_dir}: already holds {name} (an earlier evaluation's results, which this "
                              "one would replace): give another --out folder")  # fmt: skip
