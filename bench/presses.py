"""KV presses against NVIDIA's kvpress on the same pretrained model and tokens (issue 17, item 4).

    python bench/presses.py --hf DIR [--ref models/SmolLM2-135M-Instruct.Q4_1.gguf] [--contexts 1024,2048,4096]
                            [--ratios 0.5,0.75] [--slots 128,256] [--presses streaming,snapkv,tova,knorm]
                            [--decode-kinds h2o,quest,tova,knorm] [--windows 2] [--continuation 128]
                            [--data-dir DIR] [--no-record] [--passkey [--trials 2]]
    python bench/presses.py --plot PNG      # NLL against the KV kept, drawn from bench/results/presses.jsonl

Each window: C tokens of WikiText-2 raw test text as the context, the next `--continuation` tokens scored. The
context is prefilled with the press (kvpress: `with press(model)`, then the continuation as one forward over the
pressed cache with its true positions, as kvpress's pipeline does; attnlab: the model with `memory.kind <press>`,
`press_at: prefill`), and the NLL (nats per token) of the continuation is recorded; the first continuation token is
predicted from the prefill, before any press. Budgets: a compression ratio (the fraction dropped), or a number of
slots per KV head (kvpress: the ratio 1 - (slots + 0.5) / C, whose int() keeps exactly `slots`).

`streaming` is defined differently in the two: kvpress's StreamingLLMPress keeps 4 sinks and the newest tokens
once, after a full-attention prefill, and appends the continuation; attnlab's `streaming` memory (4 sinks + a
recent window of the same slots) slides during the prefill and the continuation too. Both are shown.

Then attnlab's selections that also act during decoding, at the same slots (attnlab only), with the continuation
decoded token by token: h2o (half heavy hitters, half recent window), quest (reads `slots` tokens a step and keeps
every one), and the presses with `press_at: decode` (pressed back to the budget after every step).

--passkey: instead of the NLL, passkey retrieval at 5 depths (the `needle` benchmark's prompt, filler sentences,
`--trials` keys per depth) at each context length and budget, through each press, attnlab's and kvpress's (the
prompt prefilled under the press, the answer decoded greedily over the pressed cache), then attnlab's decode-time
selections; a trial is correct when the continuation's first number is the key. Each arm's row is recorded when it
is done; run again, the arms already recorded for the same model, versions and trials are skipped.

kvpress 0.5.5 pins transformers below 5.3: run this in an environment with attnlab's `presses` extra (a venv of its
own: `pip install torch==2.13.0 && pip install -e '.[presses]'`). --hf is SmolLM2 as a Hugging Face folder, made
from the same GGUF by `attnlab export models/SmolLM2-135M-Instruct.Q4_1.gguf --hf DIR`, so both read the same
weights. Without kvpress the attnlab rows run alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, OtherLoad, environment, finish, print_table, row  # noqa: E402

import attnlab  # noqa: E402
from attnlab.config import MemoryConfig  # noqa: E402
from attnlab.eval.longctx import DEPTHS  # noqa: E402
from attnlab.eval.perplexity import dataset_tokens  # noqa: E402
from attnlab.eval.plots import _pyplot, _save  # noqa: E402
from attnlab.eval.records import latest_records, read_records  # noqa: E402

SMOLLM2 = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
SINKS = 4


def continuation_nll(first_logits: torch.Tensor, logits: torch.Tensor, continuation: torch.Tensor) -> float:
    """Mean NLL of `continuation` (T,): token 0 from first_logits (V,), token j from logits[j - 1] ((T, V))."""
    predictions = torch.cat((first_logits[None], logits[:-1]), dim=0).float()
    return F.cross_entropy(predictions, continuation).item()


def attnlab_nll(model, memory: MemoryConfig | None, context, continuation, stepwise: bool = False):
    """(NLL, tokens held per KV head in layer 0 after the continuation) with `memory` (None: the dense cache); the
    continuation as one chunk, or token by token (`stepwise`: a decode-time selection acts at every step)."""
    if memory is not None:
        pressed = attnlab.build_model(model.cfg.replace(memory=memory)).eval()
        pressed.load_state_dict(model.state_dict(), assign=True)  # the same tensors, no copy
        model = pressed
    with torch.no_grad():
        cache = model.new_cache(1, None if memory is not None else len(context) + len(continuation))
        first = model(context[None], cache)[0][0, -1]
        if stepwise:
            logits = torch.cat([model(continuation[None, t : t + 1], cache)[0][0] for t in range(len(continuation))])
        else:
            logits = model(continuation[None], cache)[0][0]
    held = cache.layers[0].positions().shape[-1]
    return continuation_nll(first, logits, continuation), held


def kvpress_nll(hf, press, context, continuation) -> float:
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache()
        if press is None:
            first = hf(context[None], past_key_values=cache).logits[0, -1]
        else:
            with press(hf):
                first = hf(context[None], past_key_values=cache).logits[0, -1]
        positions = torch.arange(len(context), len(context) + len(continuation))[None]
        logits = hf(continuation[None], past_key_values=cache, position_ids=positions).logits[0]
    return continuation_nll(first, logits, continuation)


def attnlab_answer(model, memory: MemoryConfig | None, prompt: list[int], new: int) -> list[int]:
    """Greedy continuation of `prompt` (new tokens) with `memory` (None: the dense cache). generate prefills a
    press-at-prefill model's prompt as one chunk, as kvpress does."""
    if memory is not None:
        pressed = attnlab.build_model(model.cfg.replace(memory=memory)).eval()
        pressed.load_state_dict(model.state_dict(), assign=True)
        model = pressed
    return attnlab.generate(model, prompt, max_new_tokens=new, temperature=0.0, compile=False).tolist()


def kvpress_answer(hf, press, prompt: list[int], new: int) -> list[int]:
    """kvpress's setting: the prompt prefilled under the press, then greedy decoding over the pressed cache with
    the true positions (nothing pressed again)."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        cache = DynamicCache()
        if press is None:
            logits = hf(ids, past_key_values=cache).logits[0, -1]
        else:
            with press(hf):
                logits = hf(ids, past_key_values=cache).logits[0, -1]
        for step in range(new):
            token = int(logits.argmax())
            out.append(token)
            if step + 1 < new:
                position = torch.tensor([[len(prompt) + step]])
                logits = hf(torch.tensor([[token]]), past_key_values=cache, position_ids=position).logits[0, -1]
    return out


def passkey_done(name: str, config_hash: str, versions: dict, trials: int) -> dict[tuple, dict]:
    """The passkey rows already in bench/results/<name>.jsonl for this model, these package versions and this
    number of trials, by (context, press, budget): a stopped run goes on where it stopped."""
    path = RESULTS_DIR / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    same = lambda r: (r.get("config_hash") == config_hash and r.get("trials") == trials * len(DEPTHS)  # noqa: E731
                      and all(r.get(k) == v for k, v in versions.items()))  # fmt: skip
    return {(r["context"], r["press"], r["budget"]): r for r in rows if same(r)}


def passkey(args, model, tokenizer, hf, versions, env) -> list[list]:
    """Passkey retrieval at 5 depths through each press, attnlab's and kvpress's, at each context length and
    budget; then attnlab's decode-time selections. A trial is correct when the greedy continuation's first number
    is the key (the `needle` benchmark's rule). Each arm's row is recorded as soon as it is done, and arms already
    recorded (same model, versions and trials) are read back instead of run again, unless --no-record."""
    from attnlab.eval.longctx import FILLER, _starts_with_key, passkey_prompt

    filler = torch.as_tensor(tokenizer.encode(" " + FILLER)).numpy()
    keys = [str(10000 + 7919 * (t + 1) % 90000) for t in range(args.trials)]
    done = {} if args.no_record else passkey_done("presses_passkey", model.cfg.config_hash(), versions, args.trials)
    table = []
    for context in [int(x) for x in args.contexts.split(",") if x]:
        arms = [("none", "full", None, None)]
        ratios, slots = [float(x) for x in args.ratios.split(",") if x], [int(x) for x in args.slots.split(",") if x]
        for label, ratio, kept in budgets(context, ratios, slots):
            for press in [p for p in args.presses.split(",") if p]:
                theirs = kvpress_press(press, ratio) if hf is not None else None
                arms.append((press, label, attnlab_memory(press, ratio, kept, label), theirs))
            for kind in [k for k in args.decode_kinds.split(",") if k]:
                arms.append((f"{kind} (decode)", label, decode_memory(kind, kept), "attnlab only"))
        for press, label, memory, theirs in arms:
            if (context, press, label) in done:
                r = done[context, press, label]
                table.append([context, press, label, r["attnlab_accuracy"], r["kvpress_accuracy"]])
                print(f"passkey C={context} {press:16s} {label:10s} recorded before", flush=True)
                continue
            ours_ok, theirs_ok, trials = 0, 0, 0
            for depth in DEPTHS:
                for key in keys:
                    prompt = passkey_prompt(tokenizer, filler, context, depth, key)
                    new = len(prompt.answer) + 2
                    ours = tokenizer.decode(attnlab_answer(model, memory, prompt.with_needle, new)[-new:])
                    ours_ok += _starts_with_key(ours, key)
                    if hf is not None and theirs != "attnlab only":
                        text = tokenizer.decode(kvpress_answer(hf, theirs, prompt.with_needle, new))
                        theirs_ok += _starts_with_key(text, key)
                    trials += 1
            kv = None if hf is None or theirs == "attnlab only" else theirs_ok / trials
            record = row("presses_passkey", model.cfg.config_hash(), env, context=context, press=press, budget=label,
                         trials=trials, depths=list(DEPTHS), attnlab_accuracy=ours_ok / trials, kvpress_accuracy=kv,
                         **versions)  # fmt: skip
            finish("presses_passkey", [record], None, record=not args.no_record)  # accuracy: the load does not matter
            table.append([context, press, label, ours_ok / trials, kv])
            print(f"passkey C={context} {press:16s} {label:10s} attnlab {ours_ok}/{trials}"
                  + ("" if kv is None else f" kvpress {theirs_ok}/{trials}"), flush=True)  # fmt: skip
    return table


def nll_by_budget(records: list[dict]) -> dict[int, dict[str, list[tuple[float, float, int]]]]:
    """{context: {line label: [(share of the context's KV kept, mean NLL over windows, windows), ...]}} from the
    `presses` records: the latest row of each cell (attnlab.eval.records.latest_records); a line per press and
    implementation (the full cache at share 1 on every line), a point only where every window of that context
    was scored, so the lines compare the same tokens."""
    cells: dict[tuple, dict[int, float]] = {}
    for r in latest_records([r for r in records if r.get("benchmark") == "presses"])[0]:
        kept = 1.0 if r["press"] == "none" else r["slots"] / r["context"]
        impl = "attnlab" if r["press"] == "none" else r["impl"]  # the full cache is the same model in both
        cells.setdefault((r["context"], r["press"], impl, kept), {})[r["window"]] = r["nll"]
    out: dict[int, dict[str, list]] = {}
    for (context, press, impl, kept), by_window in cells.items():
        full = cells.get((context, "none", "attnlab", 1.0))
        if press == "none" or full is None or set(by_window) != set(full):
            continue
        label = press if "(decode)" in press else f"{press}, {impl}"
        out.setdefault(context, {}).setdefault(label, []).append((kept, sum(by_window.values()) / len(by_window),
                                                                   len(by_window)))  # fmt: skip
    for context, lines in out.items():
        full = cells[context, "none", "attnlab", 1.0]
        for points in lines.values():
            points.append((1.0, sum(full.values()) / len(full), len(full)))
            points.sort()
    return out


def plot_nll_by_budget(records: list[dict], path: Path) -> Path | None:
    """NLL of the continuation against the share of the context's KV kept, a panel per context, a line per press
    (kvpress's dashed); None when no context has a whole set of windows."""
    lines_by_context = nll_by_budget(records)
    if not lines_by_context:
        return None
    plt = _pyplot()
    contexts = sorted(lines_by_context)
    presses = sorted({label.split(",")[0] for lines in lines_by_context.values() for label in lines})
    color = {press: plt.cm.tab10(i % 10) for i, press in enumerate(presses)}  # one press, one colour
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.2 * len(contexts), 4.2), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        for label, points in sorted(lines_by_context[context].items()):
            style = "--" if label.endswith("kvpress") else (":" if "(decode)" in label else "-")
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", ms=3, label=label,
                    color=color[label.split(",")[0]])  # fmt: skip
        n = max(p[2] for points in lines_by_context[context].values() for p in points)
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {context:,} tokens ({n} window{'s' if n > 1 else ''})", fontsize=9)
        ax.set_xlabel("share of the context's KV kept (per KV head)")
        ax.set_ylabel("NLL of the next tokens (nats)")
        ax.grid(alpha=0.3, which="both", lw=0.4)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, path)


def budgets(context: int, ratios: list[float], slots: list[int]) -> list[tuple[str, float, int]]:
    """(label, kvpress ratio, slots kept per KV head) for each budget that leaves something to drop."""
    out = [(f"ratio {r:g}", r, max(1, int(context * (1.0 - r)))) for r in ratios]
    out += [(f"{s} slots", 1.0 - (s + 0.5) / context, s) for s in slots if s < context]
    return out


PAGE = 16  # quest's page size in the decode-time rows


def decode_memory(kind: str, slots: int) -> MemoryConfig:
    """attnlab's decode-time selections at `slots` tokens per KV head (attnlab only: kvpress has no such rows).
    h2o: half heavy hitters, half recent window; quest: a window of 64, 4 sinks, the rest in pages of 16 (it holds
    every token and reads `slots`); a press: pressed back to `slots` after every update (press_at decode)."""
    if kind == "h2o":
        return MemoryConfig(kind="h2o", recent_window=slots - slots // 2, heavy_slots=slots // 2)
    if kind == "quest":
        return MemoryConfig(kind="quest", recent_window=64, page_size=PAGE, sink_tokens=SINKS,
                            pages=max(1, (slots - 64 - SINKS) // PAGE))  # fmt: skip
    return MemoryConfig(kind=kind, budget=slots, press_at="decode")


def attnlab_memory(press: str, ratio: float, slots: int, label: str) -> MemoryConfig:
    if press == "streaming":
        return MemoryConfig(kind="streaming", sink_tokens=SINKS, recent_window=slots - SINKS)
    budget = {"budget": slots} if label.endswith("slots") else {"compression_ratio": ratio}
    return MemoryConfig(kind=press, **budget)


def kvpress_press(press: str, ratio: float):
    import kvpress

    make = {"streaming": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=SINKS),
            "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio),
            "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
            "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio)}  # fmt: skip
    return make[press]()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default=SMOLLM2)
    parser.add_argument("--hf", help="the same model as a Hugging Face folder (attnlab export REF --hf DIR)")
    parser.add_argument("--contexts", default="1024,2048,4096")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--slots", default="128,256")
    parser.add_argument("--presses", default="streaming,snapkv,tova,knorm")
    parser.add_argument(
        "--decode-kinds",
        default="h2o,quest,tova,knorm",
        help="attnlab-only rows that select during decoding too, at the same slots ('' for none)",
    )
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--passkey", action="store_true",
                        help="passkey retrieval at 5 depths instead of the continuation's NLL")  # fmt: skip
    parser.add_argument("--trials", type=int, default=2, help="--passkey: keys per depth")
    parser.add_argument("--plot", metavar="PNG", help="draw NLL against the KV kept from the records, run nothing")
    args = parser.parse_args(argv)
    if args.plot:
        path = RESULTS_DIR / "presses.jsonl"
        drawn = plot_nll_by_budget(read_records(path, "presses"), Path(args.plot))
        print(f"wrote {drawn}" if drawn else f"no context in {path} has every window scored: nothing drawn")
        return 0 if drawn else 2
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    contexts, slots = ints(args.contexts), ints(args.slots)
    ratios = [float(x) for x in args.ratios.split(",") if x]
    presses = [p for p in args.presses.split(",") if p]
    decode_kinds = [k for k in args.decode_kinds.split(",") if k]

    cfg, model, tokenizer = attnlab.load_model(args.ref, data_dir=args.data_dir)
    stream = torch.as_tensor(dataset_tokens(tokenizer, "wikitext2-raw", "test", args.data_dir))
    hf, versions = None, {"attnlab": attnlab.__version__}
    if importlib.util.find_spec("kvpress") is None or args.hf is None:
        print("kvpress rows skipped: " + ("no --hf folder" if args.hf is None else "kvpress is not installed"))
    else:
        import kvpress
        import transformers
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
        versions.update(kvpress=kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
                        transformers=transformers.__version__)  # fmt: skip
    print("versions:", versions)
    env, records, table = environment(), [], []
    load = OtherLoad()
    if args.passkey:
        table = passkey(args, model, tokenizer, hf, versions, env)
        print_table(["context", "press", "budget", "attnlab accuracy", "kvpress accuracy"], table, ".2f")
        return 0
    for context in contexts:
        span = context + args.continuation
        for window in range(args.windows):
            tokens = stream[window * span : (window + 1) * span]
            if len(tokens) < span:
                break
            ctx, cont = tokens[:context], tokens[context:]
            base = {"context": context, "window": window, "continuation": args.continuation, **versions}
            dense, _ = attnlab_nll(model, None, ctx, cont)
            records.append(row("presses", cfg.config_hash(), env, **base, press="none", budget="full",
                               impl="attnlab", nll=dense))  # fmt: skip
            hf_dense = kvpress_nll(hf, None, ctx, cont) if hf is not None else None
            if hf is not None:
                records.append(row("presses", cfg.config_hash(), env, **base, press="none", budget="full",
                                   impl="kvpress", nll=hf_dense))  # fmt: skip
            table.append([context, window, "none", "full", dense, hf_dense, None])
            for press in presses:
                for label, ratio, kept in budgets(context, ratios, slots):
                    ours, held = attnlab_nll(model, attnlab_memory(press, ratio, kept, label), ctx, cont)
                    theirs = kvpress_nll(hf, kvpress_press(press, ratio), ctx, cont) if hf is not None else None
                    for impl, nll in (("attnlab", ours), ("kvpress", theirs)):
                        if nll is not None:
                            records.append(row("presses", cfg.config_hash(), env, **base, press=press,
                                               budget=label, slots=kept, held_after=held, impl=impl,
                                               nll=nll, dense_nll=dense))  # fmt: skip
                    delta = None if theirs is None else ours - theirs
                    table.append([context, window, press, label, ours, theirs, delta])
                    print(
                        f"C={context} w={window} {press:9s} {label:10s} attnlab {ours:.4f}"
                        + ("" if theirs is None else f" kvpress {theirs:.4f} diff {delta:+.4f}"),
                        flush=True,
                    )
            for kind in decode_kinds:  # attnlab's selections during decoding, at the same slots
                for label, _, kept in budgets(context, ratios, slots):
                    ours, held = attnlab_nll(model, decode_memory(kind, kept), ctx, cont, stepwise=True)
                    records.append(row("presses", cfg.config_hash(), env, **base, press=f"{kind} (decode)",
                                       budget=label, slots=kept, held_after=held, impl="attnlab", nll=ours,
                                       dense_nll=dense))  # fmt: skip
                    table.append([context, window, f"{kind} (decode)", label, ours, None, None])
                    print(f"C={context} w={window} {kind + ' (decode)':16s} {label:10s} attnlab {ours:.4f}", flush=True)
    print_table(["context", "window", "press", "budget", "attnlab NLL", "kvpress NLL", "diff"], table, ".4f")
    finish("presses", records, load.fraction(), record=not args.no_record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
