"""A real model's speed side by side in one run (issue 16): SmolLM2-135M (the GGUF in the data directory) on this
CPU, attnlab with fp32 / Q8_0 / the file's own (Q4_1) weights and fp32 / fp16 / q8_0 / q4_0 KV caches, transformers
(fp32), and llama.cpp (llama-cpp-python, optional: skipped with a note when it is not installed) with f16 / q8_0 /
q4_0 KV caches, at 1 and 2 threads.

    python bench/real_model.py [--threads 1,2] [--contexts 128,4096,8192] [--prefill 512,4096] [--new-tokens 32]
                               [--impls attnlab,transformers,llama.cpp] [--weights fp32,q8_0,native,native+q8]
                               [--kv fp32,fp16,q8_0,q4_0] [--models REF,...] [--repeats 2] [--data-dir DIR]
                               [--no-record]

decode   after an untimed prefill of C - N - 1 tokens of WikiText-2 raw test, N single-token steps, the last at
         C tokens of context (attnlab: `generate`'s own loop, its fused step where it applies (native+q8 with an
         fp32, fp16, q8_0 or q4_0 cache: attnlab.model.fused), else its compiled step, timed token by token
         through its callback after a warm-up run; transformers: its forward with past_key_values; llama.cpp:
         `Llama.eval([token])`), tok/s
         = N / seconds, median of rounds. Bytes per token: the weights read (every matrix once; the embedding's one
         row is left out unless it is also the LM head) plus the KV cache read at context C, against the machine's
         read bandwidth measured in the same run (a 1 GiB fp32 sum), as a share of what the bandwidth allows.
prefill  L tokens into a fresh cache: attnlab in chunks of 512 (generate's default), transformers one forward,
         llama.cpp `Llama.eval` (its n_batch 512); L / seconds.
Every ratio is to llama.cpp with its f16 KV cache at the same threads and length, measured in the same run;
--models adds other attnlab references (e.g. the decoupled and MLA conversions of configs/retrofit) to the
attnlab rows. Pass llama-cpp-python as `pip install ../shared/wheels/llama_cpp_python-*.whl` (built here from its
source) or `pip install llama-cpp-python` (builds from source, about 15 minutes).
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, environment, finish, median, print_table, row  # noqa: E402

import attnlab  # noqa: E402
from attnlab.errors import AttnlabError  # noqa: E402
from attnlab.eval.loading import WEIGHTS, load_for_eval  # noqa: E402
from attnlab.eval.perplexity import dataset_tokens  # noqa: E402
from attnlab.generate import generate, prefill_last  # noqa: E402
from attnlab.interop.references import model_config_of  # noqa: E402
from attnlab.paths import check_data_dirs, find_data_file, shown_value  # noqa: E402

IMPLS = ("attnlab", "transformers", "llama.cpp")
SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
KV_POLICIES = {"fp32": None, "fp16": "k=fp16,v=fp16", "q8_0": "k=q8_0,v=q8_0", "q4_0": "k=q4_0,v=q4_0"}
LLAMA_KV = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids (GGML_TYPE_F16, _Q8_0, _Q4_0)
LLAMA_KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per cached value


def read_bandwidth(gib: float = 1.0, repeats: int = 3) -> float:
    """Bytes per second of the fastest of `repeats` sums over a `gib` GiB fp32 tensor (torch's threads)."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = min(_seconds(lambda: x.sum()) for _ in range(repeats))
    return x.nbytes / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_weights(weights: list[str]) -> list[str]:
    """The --weights values a --models reference takes: each but the GGUF's own (native, native+q8), which a converted
    model does not have (its weights are fp32); fp32 when only those were given."""
    return [w for w in weights if not w.startswith("native")] or ["fp32"]


def weight_bytes(model) -> int:
    """Bytes of every distinct tensor of the model read per token: parameters and buffers once each (a tied
    embedding and LM head are one table, read whole by the head), less an untied embedding (one row read) and the
    RoPE tables."""
    seen, total = set(), 0
    # RoPE's cos/sin tables are read one row (the position) per token: left out like the embedding.
    # A layer's packed rows (set_activations "q8") are read instead of its blocks, and have their size: counted once.
    buffers = [t for name, t in model.named_buffers() if "rotary" not in name and not name.endswith(".packed")]
    for t in [*model.parameters(), *buffers]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed", None)
    shared = (
        head is not None
        and embed is not None
        and any(a.data_ptr() == b.data_ptr() for a in embed.parameters() for b in head.parameters())
    )
    tied = shared or getattr(model.cfg, "tie_embeddings", False)
    if embed is not None and not tied:
        total -= sum(t.nbytes for t in [*embed.parameters(), *embed.buffers()])
    return total


class Attnlab:
    """attnlab's generate on a loaded model, with a KV policy."""

    impl = "attnlab"

    def __init__(self, ref: str, weights: str, kv: str, data_dir):
        held, _, activations = weights.partition("+")  # native+q8: the file's weights, 8-bit activations
        loaded = load_for_eval(ref, data_dir=data_dir, weights=held, activations=activations or "fp32")
        self.model = loaded.model  # labelled by the file's stem, a run by <target>/seed<S>
        label = Path(ref).stem if Path(ref).is_file() else loaded.name
        self.label, self.weights, self.kv, self.policy = label, weights, kv, KV_POLICIES[kv]
        self.weight_bytes = weight_bytes(self.model)

    def kv_bytes_per_token(self, context: int) -> float:
        cache = self.model.new_cache(1, context, **({"policy": self.policy} if self.policy else {}))
        with torch.no_grad():
            prefill_last(self.model, torch.zeros(1, context, dtype=torch.long), cache)
        return cache.nbytes() / context

    def decode(self, tokens: torch.Tensor, n: int) -> float:
        stamps = []
        generate(self.model, tokens, max_new_tokens=n + 1, kv_policy=self.policy, compile=True,
                 callback=lambda _: stamps.append(time.perf_counter()))  # fmt: skip
        return (stamps[-1] - stamps[0]) / n  # seconds per step after the first token (prefill excluded)

    def prefill(self, tokens: torch.Tensor) -> float:
        cache = self.model.new_cache(1, tokens.shape[1], **({"policy": self.policy} if self.policy else {}))
        with torch.no_grad():
            return _seconds(lambda: prefill_last(self.model, tokens, cache))


class Transformers:
    impl, weights, kv = "transformers", "fp32", "fp32"

    def __init__(self, path: Path):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        self.label = path.stem
        self.weight_bytes = weight_bytes_hf(self.model)
        cfg = self.model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # fp32 keys, values

    def kv_bytes_per_token(self, context: int) -> float:
        return self.kv_per_token

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, n: int) -> float:
        out = self.model(tokens, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(n):
            out = self.model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / n

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> float:
        return _seconds(lambda: self.model(tokens, use_cache=True))


def weight_bytes_hf(model) -> int:
    seen, total = set(), 0
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    if not model.config.tie_word_embeddings:
        total -= model.get_input_embeddings().weight.nbytes
    return total


class LlamaCpp:
    impl, weights = "llama.cpp", "native"

    def __init__(self, path: Path, kv: str, threads: int, n_ctx: int):
        import llama_cpp

        kv_type = LLAMA_KV[kv]
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   type_k=kv_type, type_v=kv_type, flash_attn=True, verbose=False)  # fmt: skip
        self.label, self.kv = path.stem, kv
        from attnlab.interop.gguf_table import read_gguf_table

        sizes = {t.name: int(t.n_bytes) for t in read_gguf_table(path).tensors}
        # A separate output.weight is the LM head: the embedding table is then read one row per token.
        self.weight_bytes = sum(sizes.values()) - (sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0)
        meta = self.llm.metadata
        layers, heads = int(meta["llama.block_count"]), int(meta["llama.attention.head_count"])
        kv_heads, width = int(meta["llama.attention.head_count_kv"]), int(meta["llama.embedding_length"])
        self.kv_per_token = 2 * layers * kv_heads * (width // heads) * LLAMA_KV_BYTES[kv]

    def kv_bytes_per_token(self, context: int) -> float:
        return self.kv_per_token

    def decode(self, tokens: torch.Tensor, n: int) -> float:
        ids = tokens[0].tolist()
        self.llm.reset()
        self.llm.eval(ids)
        start = time.perf_counter()
        for i in range(n):
            self.llm.eval([ids[i % len(ids)]])  # one token per step: the token's value does not change the cost
        return (time.perf_counter() - start) / n

    def prefill(self, tokens: torch.Tensor) -> float:
        self.llm.reset()
        return _seconds(lambda: self.llm.eval(tokens[0].tolist()))


def llama_cpp_problem(path: Path) -> str | None:
    """Why llama-cpp-python cannot evaluate the GGUF at `path` on this machine, or None: tried in a child process,
    since a build for another CPU dies of an illegal instruction (SIGILL) and would take the benchmark with it."""
    probe = "import llama_cpp, sys; llama_cpp.Llama(sys.argv[1], n_ctx=32, verbose=False).eval([1, 2])"
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    if done.returncode == -signal.SIGILL:
        return ("it died of an illegal instruction: the wheel was built for a CPU with instructions this one lacks; "
                "build it here: pip install --no-binary llama-cpp-python llama-cpp-python, ~15 minutes")  # fmt: skip
    last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return f"a test evaluation failed: {last}"


class Parser(argparse.ArgumentParser):
    """argparse's parser, refusing a bad option in one line `real_model.py: error: ...` (exit code 2), no usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _numbers(parser: Parser, flag: str, value: str, least: float, what: str) -> list[int]:
    """The whole numbers of a comma list (empty items skipped), each at least `least`, else the one-line refusal."""
    numbers = []
    for item in filter(None, (x.strip() for x in value.split(","))):
        try:
            numbers.append(int(item))
        except ValueError:
            parser.error(f"{flag} {shown_value(value)}: {item!r} is not a whole number ({what})")
        if numbers[-1] < least:
            parser.error(f"{flag} {shown_value(value)}: {item} is not a {what}")
    return numbers


def _names(parser: Parser, flag: str, value: str, known, what: str) -> list[str]:
    """The names of a comma list, at least one, each one of `known`, else the one-line refusal."""
    names = [x.strip() for x in value.split(",") if x.strip()]
    choices = ", ".join(known)
    for name in names:
        if name not in known:
            parser.error(f"{flag} {shown_value(value)}: {name!r} is not one of {what} ({choices})")
    if not names:
        parser.error(f"{flag} {shown_value(value)} names nothing: give one or more of {what} ({choices})")
    return list(dict.fromkeys(names))


def _weights(parser: Parser, value: str) -> list[str]:
    """--weights: WEIGHTS choices, each optionally +q8 (8-bit activations, for the block-quantized ones)."""
    blocks = [w for w in WEIGHTS if w not in ("fp32", "fp16")]
    choices = f"{', '.join(WEIGHTS)}; +q8 after {', '.join(blocks)} (8-bit activations), e.g. native+q8"
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names:
        parser.error(f"--weights {shown_value(value)} names nothing: give one or more attnlab weights ({choices})")
    for name in names:
        held, plus, activations = name.partition("+")
        if held not in WEIGHTS:
            parser.error(f"--weights {shown_value(value)}: {held!r} is not one of attnlab's weights ({choices})")
        if plus and activations != "q8":
            parser.error(
                f"--weights {shown_value(value)}: {name!r}: after '+' only q8 is known (8-bit "
                "activations, e.g. native+q8)"
            )
        if plus and held not in blocks:
            parser.error(f"--weights {shown_value(value)}: {name!r}: q8 activations need block-quantized weights "
                         f"(+q8 after {', '.join(blocks)})")  # fmt: skip
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> tuple[Parser, argparse.Namespace]:
    """The options, every one checked (AD8/AD9/U10 of probe AD: nothing slow runs before a bad one is refused);
    the comma lists as lists. The lengths against the model's context: check_lengths, after reading its header."""
    parser = Parser(prog="real_model.py", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--contexts", default="128,4096,8192", help="decode at these contexts ('': none)")
    parser.add_argument("--prefill", default="512,4096", help="prefill lengths ('': none)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--impls", default="attnlab,transformers,llama.cpp")
    parser.add_argument(
        "--weights",
        default="fp32,q8_0,native",
        help="attnlab weights (eval.loading.WEIGHTS); "
        "+q8 after one: 8-bit activations (attnlab.set_activations), e.g. native+q8",
    )
    parser.add_argument("--kv", default="fp32,q8_0,q4_0", help="attnlab KV caches (fp32, fp16, q8_0, q4_0)")
    parser.add_argument("--llama-kv", default="f16,q8_0,q4_0", help="llama.cpp KV caches")
    parser.add_argument(
        "--models",
        default="",
        help="other attnlab references, comma-separated (with each --weights "
        "value but native ones; fp32 when only those)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--no-record", action="store_true", help="print only (do not append to bench/results)")
    args = parser.parse_args(argv)
    for flag, number in (("--new-tokens", args.new_tokens), ("--repeats", args.repeats)):
        if number < 1:
            parser.error(f"{flag} {number}: must be at least 1")
    n = args.new_tokens
    given = args.threads
    args.threads = _numbers(parser, "--threads", given, 1, "positive number of threads")
    if not args.threads:
        parser.error(f"--threads {shown_value(given)} names nothing: give positive numbers of threads, e.g. 1,2")
    args.contexts_given, args.prefill_given = args.contexts, args.prefill
    args.contexts = _numbers(parser, "--contexts", args.contexts, float("-inf"), "context length")  # least: below
    for context in args.contexts:
        if context < n + 2:  # the prompt before the N timed steps is C - N - 1 tokens: at least one
            parser.error(f"--contexts {shown_value(args.contexts_given)}: {context} leaves no prompt before the "
                         f"{n} timed new tokens (--new-tokens {n}): give contexts of at least {n + 2} "
                         "(--new-tokens + 2)")  # fmt: skip
    args.prefill = _numbers(parser, "--prefill", args.prefill, 1, "positive prefill length")
    if not args.contexts and not args.prefill:
        parser.error(f"--contexts {shown_value(args.contexts_given)} and --prefill {shown_value(args.prefill_given)}: "
                     "nothing to measure (give decode contexts, prefill lengths, or both)")  # fmt: skip
    args.impls = _names(parser, "--impls", args.impls, IMPLS, "the implementations")
    args.weights = _weights(parser, args.weights)
    args.kv = _names(parser, "--kv", args.kv, list(KV_POLICIES), "attnlab's KV caches here")
    args.llama_kv = _names(parser, "--llama-kv", args.llama_kv, list(LLAMA_KV), "llama.cpp's KV caches here")
    args.models = [x.strip() for x in args.models.split(",") if x.strip()]
    try:
        check_data_dirs(args.data_dir)
    except AttnlabError as e:
        parser.error(str(e))
    return parser, args


def check_lengths(parser: Parser, args: argparse.Namespace, path: Path) -> None:
    """The contexts and prefill lengths against the context of the model at `path` and of every --models one, and
    those models' vocabulary against its (the prompts are its tokens): from their headers and configs alone."""
    try:
        cfg = model_config_of(path)
    except AttnlabError as e:
        parser.error(str(e))
    for flag, lengths, given in (("--contexts", args.contexts, args.contexts_given),
                                 ("--prefill", args.prefill, args.prefill_given)):  # fmt: skip
        if max(lengths, default=0) > cfg.max_seq_len:
            parser.error(f"{flag} {shown_value(given)}: {max(lengths)} is past {path.stem}'s max_seq_len "
                         f"{cfg.max_seq_len} (its context): give lengths up to {cfg.max_seq_len}")  # fmt: skip
    longest = max(args.contexts + args.prefill)
    for ref in args.models:
        try:
            other = model_config_of(ref, args.data_dir)
        except AttnlabError as e:
            parser.error(f"--models {shown_value(ref)}: {e}")
        if other.vocab_size < cfg.vocab_size:  # (a larger one, e.g. padded by a conversion, reads the ids)
            parser.error(
                f"--models {shown_value(ref)}: its vocab_size {other.vocab_size} is below {path.stem}'s "
                f"{cfg.vocab_size}: the prompts are {path.stem}'s tokens (give models converted from it)"
            )
        if other.max_seq_len < longest:
            parser.error(f"--models {shown_value(ref)}: its max_seq_len {other.max_seq_len} is below the longest "
                         f"length asked, {longest} (give shorter --contexts / --prefill)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    try:
        path = find_data_file(SMOLLM2, args.data_dir)
    except AttnlabError as e:
        parser.error(str(e))
    check_lengths(parser, args, path)
    impls = set(args.impls)
    if "llama.cpp" in impls and importlib.util.find_spec("llama_cpp") is None:
        print(
            "llama-cpp-python is not installed: its rows are skipped (pip install "
            "../shared/wheels/llama_cpp_python-*.whl, or pip install llama-cpp-python to build it, ~15 minutes)"
        )
        impls.discard("llama.cpp")
    elif "llama.cpp" in impls and (problem := llama_cpp_problem(path)):
        print(f"llama-cpp-python cannot run here: its rows are skipped ({problem})")
        impls.discard("llama.cpp")
    if not impls:
        parser.error("--impls llama.cpp: llama-cpp-python cannot run here (see above), and nothing else is asked: "
                     "nothing to measure (add attnlab or transformers)")  # fmt: skip
    try:
        measure(args, path, impls)
    except AttnlabError as e:  # what the checks above cannot see: one line, as attnlab's CLI says it
        print(f"real_model.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


def measure(args: argparse.Namespace, path: Path, impls: set[str]) -> None:
    """Runs the measurements of the checked options and prints (and records) them."""
    contexts, lengths = args.contexts, args.prefill
    n = args.new_tokens
    tokenizer = attnlab.load_model(path)[2]  # the GGUF's own
    text = torch.from_numpy(
        dataset_tokens(tokenizer, "wikitext2-raw", "test", args.data_dir)[: max(contexts + lengths) + 1].astype("int64")
    )[None]
    other, records, decode_rows, prefill_rows = OtherLoad(), [], [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        env = environment()
        bandwidth = read_bandwidth()
        print(f"\n{threads} thread(s): read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
        runners = []
        if "llama.cpp" in impls:
            runners += [LlamaCpp(path, kv, threads, max(contexts + lengths) + n + 8) for kv in args.llama_kv]
        if "attnlab" in impls:
            runners += [Attnlab(str(path), w, kv, args.data_dir) for w in args.weights
                        for kv in args.kv]  # fmt: skip
            runners += [Attnlab(ref, w, kv, args.data_dir) for ref in args.models for w in model_weights(args.weights)
                        for kv in args.kv]  # fmt: skip
        if "transformers" in impls:
            runners.append(Transformers(path))
        for context in contexts:
            prompt = text[:, : context - n - 1]  # the last step decodes at C tokens of context (8,192 = SmolLM2's max)
            speeds = {}
            for runner in runners:
                runner.decode(prompt, 2)  # warm-up (attnlab: compiles its step for this cache size)
                other.lap()
                seconds = median([runner.decode(prompt, n) for _ in range(args.repeats)])
                load = other.lap()
                key = (runner.impl, runner.label, runner.weights, runner.kv)
                speeds[key] = 1 / seconds
                moved = runner.weight_bytes + runner.kv_bytes_per_token(context) * context
                figures = {"part": "decode", "impl": runner.impl, "model": runner.label, "weights": runner.weights,
                           "kv": runner.kv, "context": context, "new_tokens": n, "tok_per_s": 1 / seconds,
                           "bytes_per_token": moved, "bandwidth_bytes_per_s": bandwidth,
                           "bandwidth_share": moved / seconds / bandwidth, "other_load_round": load}  # fmt: skip
                records.append(row("real_model", runner.label, env, **figures))
                print(f"  decode {context:>5} {runner.impl:>12} {runner.weights:>6} {runner.kv:>5} "
                      f"{1 / seconds:7.1f} tok/s", flush=True)  # fmt: skip
            reference = next((v for k, v in speeds.items() if k[0] == "llama.cpp" and k[3] == "f16"), None)
            for (impl, label, weights, kv), speed in speeds.items():
                rec = next(r for r in records[::-1] if r["impl"] == impl and r["model"] == label
                           and r["weights"] == weights and r["kv"] == kv and r["context"] == context)  # fmt: skip
                rec["ratio_vs_llama_cpp"] = speed / reference if reference else None
                decode_rows.append([threads, context, impl, label, weights, kv, speed,
                                    rec["ratio_vs_llama_cpp"] or "-", rec["bytes_per_token"] / 1e6,
                                    rec["bandwidth_share"]])  # fmt: skip
        for length in lengths:
            ids = text[:, :length]
            speeds = {}
            for runner in runners:
                runner.prefill(ids[:, : min(length, 256)])  # warm-up
                seconds = median([runner.prefill(ids) for _ in range(args.repeats)])
                speeds[(runner.impl, runner.label, runner.weights, runner.kv)] = length / seconds
                print(f"  prefill {length:>5} {runner.impl:>12} {runner.weights:>6} {runner.kv:>5} "
                      f"{length / seconds:7.1f} tok/s", flush=True)  # fmt: skip
            reference = next((v for k, v in speeds.items() if k[0] == "llama.cpp" and k[3] == "f16"), None)
            for (impl, label, weights, kv), speed in speeds.items():
                ratio = speed / reference if reference else None
                figures = {"part": "prefill", "impl": impl, "model": label, "weights": weights, "kv": kv,
                           "tokens": length, "tok_per_s": speed, "ratio_vs_llama_cpp": ratio}  # fmt: skip
                records.append(row("real_model", label, env, **figures))
                prefill_rows.append([threads, length, impl, label, weights, kv, speed, ratio or "-"])
        del runners
    print("\ndecode (tok/s, ratio to llama.cpp with an f16 KV cache, same threads and context)")
    print_table(["threads", "context", "impl", "model", "weights", "kv", "tok/s", "x llama.cpp", "MB/token",
                 "share of bandwidth"], decode_rows)  # fmt: skip
    print("\nprefill (tok/s, ratio to llama.cpp with an f16 KV cache)")
    print_table(["threads", "tokens", "impl", "model", "weights", "kv", "tok/s", "x llama.cpp"], prefill_rows)
    finish("real_model", records, other.fraction(), record=not args.no_record)


if __name__ == "__main__":
    main()
