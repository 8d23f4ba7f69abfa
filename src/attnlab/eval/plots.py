"""Figures drawn from records (pure functions of them; the attention maps come from the .npz a record names).

rank_spectra: singular values per layer (log scale), one panel per Q/K path (DBA: q_sem, q_geo, k_sem, k_geo),
plus effective rank by layer. attention_heatmaps: a layers x heads grid of attention maps. attention_by_layer:
one query's attention over the prompt, layers as rows. region_mass_bars: mass on marked regions by layer.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from attnlab.errors import AttnlabWarning

PATH_ORDER = ["q", "k", "q_sem", "k_sem", "q_geo", "k_geo", "q_nope", "k_nope", "q_rope", "k_rope"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quiet_missing_glyphs()
    return plt


def quiet_missing_glyphs() -> None:
    """Names in a script the plot's font lacks (a CJK target name) are drawn as boxes, not said in matplotlib's
    two-line UserWarning per glyph: the figure is still right, its legend names are in the tables."""
    warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font", category=UserWarning)


# Every PNG attnlab draws says so in its Software text chunk: a PNG without it at a place a command writes is the
# user's own, never replaced (attnlab_png).
PNG_METADATA = {"Software": "attnlab"}
PNG_MARK = b"tEXtSoftware\x00attnlab"


def attnlab_png(path: Path, mark: bytes = PNG_MARK) -> bool:
    """Whether the file at path is a PNG attnlab drew (its Software chunk, before the image data, says so; `mark`:
    another Software chunk to look for)."""
    with open(path, "rb") as file:
        start = file.read(4096)
    return start.startswith(b"\x89PNG") and mark in start.split(b"IDAT", 1)[0]


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    fig.clf()
    _pyplot().close(fig)
    return path


def _label(record: dict) -> str:
    return record.get("model") or record.get("kind") or "model"


def _paths(record: dict) -> list[str]:
    names = {name for layer in record["layers"] for name in layer}
    return [n for n in PATH_ORDER if n in names] + sorted(names - set(PATH_ORDER))


def rank_spectra(records: list[dict], path: str | Path) -> Path:
    """effective_rank records -> one row per record: a log-scale singular value spectrum per Q/K path (one line
    per layer, dark = first layer, light = last), and a last panel with each path's effective rank by layer
    (solid: pooled over heads; dotted: mean of the per-head ranks)."""
    plt = _pyplot()
    columns = max(len(_paths(r)) for r in records) + 1
    fig, axes = plt.subplots(len(records), columns, figsize=(3.2 * columns, 2.9 * len(records)), squeeze=False)
    for row, record in zip(axes, records, strict=True):
        paths, layers = _paths(record), record["layers"]
        colors = plt.cm.viridis(np.linspace(0, 0.9, len(layers)))
        for ax, name in zip(row, paths, strict=False):
            for i, layer in enumerate(layers):
                if name not in layer:
                    continue
                s = np.asarray(layer[name]["singular_values"])
                ax.semilogy(np.arange(1, len(s) + 1), np.maximum(s, 1e-12), color=colors[i], lw=1.2,
                            label=f"L{i}: {layer[name]['erank']:.1f}")  # fmt: skip
            width = layers[0][name]["heads"] * layers[0][name]["head_dim"] if name in layers[0] else "?"
            ax.set_title(f"{name} (width {width})", fontsize=9)
            ax.set_xlabel("index", fontsize=8)
            ax.grid(alpha=0.3, which="both", lw=0.4)
            ax.tick_params(labelsize=7)
            if len(layers) <= 12:
                ax.legend(fontsize=6, title="layer: erank", title_fontsize=6, ncol=1 + len(layers) // 7)
        row[0].set_ylabel(f"{_label(record)}\nsingular value", fontsize=8)
        for ax in row[len(paths) : -1]:
            ax.axis("off")
        ax = row[-1]
        for j, name in enumerate(paths):
            xs = [i for i, layer in enumerate(layers) if name in layer]
            color = f"C{j}"
            ax.plot(xs, [layers[i][name]["erank"] for i in xs], "o-", color=color, ms=3, label=name)
            ax.plot(xs, [np.mean(layers[i][name]["erank_heads"]) for i in xs], ":", color=color, lw=1)
        ax.set_title("effective rank (dotted: mean per head)", fontsize=9)
        ax.set_xlabel("layer", fontsize=8)
        ax.set_xticks(range(len(layers)))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    centered = "centred" if records[0].get("center") else "uncentred"
    fig.suptitle(f"Q/K projection activations (before RoPE, {centered}), {records[0].get('tokens', '?')} tokens",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    return _save(fig, path)


def _token_labels(record: dict, null: bool) -> list[str]:
    labels = [repr(t)[1:-1][:12] for t in record.get("token_text", [])]
    return (["<null>"] if null else []) + labels


def _mark_regions(ax, record: dict, null: bool, axis: str = "x") -> None:
    """Thin white lines at each region's token boundaries (key axis; query axis too when axis='xy')."""
    for region in record.get("regions", []):
        for edge in region["tokens"]:
            ax.axvline(edge - 0.5 + (1 if null else 0), color="white", lw=0.8)
            if "y" in axis:
                ax.axhline(edge - 0.5, color="white", lw=0.8, ls=":")


def attention_heatmaps(record: dict, probs: np.ndarray, path: str | Path, layers=None, heads=None,
                       max_labelled_tokens: int = 32) -> Path:  # fmt: skip
    """attention_maps record + its maps (n_layers, H, T, S) -> a grid: rows = layers, columns = heads, each cell
    queries (down) x keys (across). The colour scale is a square root of probability (faint mass stays visible).
    Prompts of at most max_labelled_tokens tokens get their tokens on the outer axes."""
    import matplotlib.colors as mcolors

    plt = _pyplot()
    layers = list(range(probs.shape[0])) if layers is None else list(layers)
    heads = list(range(probs.shape[1])) if heads is None else list(heads)
    null, length = bool(record.get("null")), probs.shape[2]
    labelled = length <= max_labelled_tokens and record.get("token_text")
    cell = max(1.6, 0.13 * length) if labelled else 1.6
    fig, axes = plt.subplots(len(layers), len(heads), figsize=(cell * len(heads) + 1.5, cell * len(layers) + 1),
                             squeeze=False, layout="constrained")  # fmt: skip
    norm = mcolors.PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    image = None
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r, c]
            image = ax.imshow(probs[layer, head], cmap="magma", norm=norm, interpolation="nearest", aspect="auto")
            if null:
                ax.axvline(0.5, color="cyan", lw=0.6)
            _mark_regions(ax, record, null)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if c == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
            if labelled and c == 0:
                ax.set_yticks(range(length), _token_labels(record, False)[:length], fontsize=6)
            if labelled and r == len(layers) - 1:
                ax.set_xticks(
                    range(probs.shape[3]), _token_labels(record, null)[: probs.shape[3]], fontsize=6, rotation=90
                )
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention probability (sqrt scale)")
    fig.suptitle(f"{_label(record)}: attention maps (rows: queries, columns: keys{', first = null' if null else ''})",
                 fontsize=10)  # fmt: skip
    return _save(fig, path)


def attention_by_layer(record: dict, probs: np.ndarray, path: str | Path, query: int = -1) -> Path:
    """One query's attention over the prompt (mean over heads), a row per layer: keys across, region
    boundaries as white lines (the seeds' dba-structural-regularization.md figure 8)."""
    plt = _pyplot()
    null, length = bool(record.get("null")), probs.shape[2]
    query = query % length
    rows = probs[:, :, query, :].mean(axis=1)  # (n_layers, S)
    fig, ax = plt.subplots(figsize=(min(16, 3 + 0.12 * probs.shape[3]), 1 + 0.45 * probs.shape[0]))
    image = ax.imshow(rows, cmap="magma", aspect="auto", interpolation="nearest", vmin=0)
    _mark_regions(ax, record, null)
    ax.set_yticks(range(probs.shape[0]), [f"layer {i}" for i in range(probs.shape[0])], fontsize=7)
    if probs.shape[3] <= 64 and record.get("token_text"):
        ax.set_xticks(range(probs.shape[3]), _token_labels(record, null), fontsize=6, rotation=90)
    else:
        ax.set_xlabel("key position" + (" (0 = null)" if null else ""))
    fig.colorbar(image, ax=ax, label="probability (mean over heads)")
    text = record.get("token_text", [])
    query_text = repr(text[query]) if query < len(text) else str(query)
    ax.set_title(f"{_label(record)}: attention of query {query} ({query_text}) by layer", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def region_mass_bars(records: list[dict], path: str | Path) -> Path:
    """attention_maps records with regions -> grouped bars by layer, one bar per (model, region): the mean over
    heads of the mass that queries after the region put on it; dots show the individual heads."""
    plt = _pyplot()
    bars = [(_label(r), region) for r in records for region in r.get("regions", [])]
    if not bars:
        raise ValueError("no regions in these records: nothing to plot")
    n_layers = max(len(region["mass"]) for _, region in bars)
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + n_layers * (0.3 + 0.25 * len(bars))), 3.8))
    for j, (label, region) in enumerate(bars):
        mass = np.asarray(region["mass"])  # (n_layers, H)
        xs = np.arange(len(mass)) + (j - (len(bars) - 1) / 2) * width
        text = region.get("text", "").strip()
        name = f"{label}: {region['name']}" + (f" ({text[:20]!r})" if text else "")
        ax.bar(xs, mass.mean(axis=1), width * 0.9, color=f"C{j}", label=name, alpha=0.85)
        for x, heads in zip(xs, mass, strict=True):
            ax.scatter(np.full(len(heads), x), heads, s=6, color="black", alpha=0.5, lw=0, zorder=3)
    ax.set_xticks(range(n_layers), [f"layer {i}" for i in range(n_layers)], fontsize=8)
    ax.set_ylabel("attention mass on region\n(queries after it; mean over heads)", fontsize=8)
    top = max(float(np.max(region["mass"])) for _, region in bars)
    ax.set_ylim(0, min(1.0, 1.1 * top + 0.02))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Attention mass on marked regions by layer (dots: heads)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_val_loss(runs: list[dict], path: str | Path) -> Path:
    """Validation loss against training tokens, one line per run (seeds of one row share a colour)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors, without = {}, []
    for run in runs:
        if not run["val_curve"]:
            without.append(run.get("dir") or run["target"])
            continue
        name = run.get("row") or run["target"] + (f" ({run['phase']})" if run["phase"] else "")
        tokens, losses = zip(*run["val_curve"], strict=True)
        label = None if name in colors else name
        line = ax.plot(tokens, losses, color=colors.get(name), label=label, linewidth=1.5, alpha=0.85)[0]
        colors.setdefault(name, line.get_color())
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Validation loss (one line per seed)")
    ax.grid(alpha=0.3)
    if colors:  # (a legend of no line is matplotlib's two-line UserWarning)
        ax.legend()
    if without:  # one line for them all
        more = f" (and {len(without) - 1} more runs)" if len(without) > 1 else ""
        warnings.warn(f"{without[0]}{more}: no validation loss history to plot (metrics.jsonl missing, or without "
                      f"val_loss rows): {Path(path).name} leaves it out", AttnlabWarning, stacklevel=2)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=PNG_METADATA)
    plt.close(fig)
    return Path(path)


def needle_grids(records: list[dict]) -> tuple[list[int], list[float], dict[str, np.ndarray]]:
    """(lengths, depths, {model: accuracy grid (depths x lengths)}) of the needle records' cells; a cell not
    measured (too long or too short for the model) is NaN, a cell measured twice holds its newest record."""
    cells = [r for r in records if r["benchmark"] == "needle" and r.get("scope") == "cell"]
    lengths, depths = sorted({r["length"] for r in cells}), sorted({r["depth"] for r in cells})
    grids = {}
    for r in cells:
        grid = grids.setdefault(_label(r), np.full((len(depths), len(lengths)), np.nan))
        grid[depths.index(r["depth"]), lengths.index(r["length"])] = r.get("accuracy", np.nan)
    return lengths, depths, grids


def needle_grid(records: list[dict], path: str | Path) -> Path | None:
    """Passkey retrieval as needle-in-a-haystack grids (`needle_grids`): one panel per model, its accuracy at each
    needle depth (rows) and prompt length (columns), green 1 to red 0, blank where not measured."""
    lengths, depths, grids = needle_grids(records)
    if not grids:
        return None
    cols = min(4, len(grids))
    rows = -(-len(grids) // cols)
    plt = _pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(1.2 + 0.55 * len(lengths) * cols, 0.6 + 0.4 * len(depths) * rows),
                             squeeze=False)  # fmt: skip
    for ax, (model, grid) in zip(axes.flat, grids.items(), strict=False):
        ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            if np.isfinite(value):
                ax.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], fontsize=6)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=6)
        ax.set_title(model, fontsize=7)
    for ax in axes.flat[len(grids) :]:
        ax.axis("off")
    fig.supxlabel("prompt tokens", fontsize=8)
    fig.supylabel("needle depth", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def record_drawings(records: list[dict]) -> dict:
    """{title: (file name, draw(path))} of the plots drawn from analysis and needle records (a report's others are
    its own)."""
    out = {}
    ranks = [r for r in records if r["benchmark"] == "effective_rank"]
    if ranks:
        out["Effective rank of the Q/K projections"] = ("rank_spectra.png", lambda path: rank_spectra(ranks, path))
    maps = [r for r in records if r["benchmark"] == "attention_maps"]
    if maps:
        out["Attention mass on marked regions"] = ("region_mass.png", lambda path: region_mass_bars(maps, path))
    if any(r["benchmark"] == "needle" for r in records):
        out["Passkey retrieval by length and depth"] = ("needle.png", lambda path: needle_grid(records, path))
    return out
