"""A model ready for evaluation: config, model (eval mode), its tokenizer and a label, from any model reference
(attnlab.interop.load_model: an attnlab run or checkpoint, a .gguf file, a Hugging Face folder, hf:ORG/NAME)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnlab.config import ModelConfig
from attnlab.errors import InputError
from attnlab.interop.references import load_reference, resolve
from attnlab.model.qlinear import FORMATS, quantize_weights, set_activations

# What `weights` may be: fp32 (every format dequantized, the default), native (a GGUF file's own formats kept), or a
# format every linear layer and the embedding are quantized to after loading (attnlab.quantize_weights).
WEIGHTS = ("fp32", "native", *FORMATS)


@dataclass
class EvalModel:
    name: str  # a label for tables: <target>/seed<S> for runs, else the file or folder name (ORG/NAME for hf:)
    path: Path  # the reference as given (hf:ORG/NAME stays a string in `str(path)`)
    cfg: ModelConfig
    model: object  # attnlab Transformer, eval mode
    tokenizer: object | None  # attnlab.data Tokenizer (None for token-level benchmarks on models without one)
    config: dict  # an attnlab run's resolved config (model, data, train); a pretrained model's {"model", "source"}
    weights: str = "fp32"  # how the weights are held (WEIGHTS)

    @property
    def device(self):
        return next(self.model.parameters()).device


def check_weights_choice(weights: str) -> None:
    """InputError unless `weights` is one of WEIGHTS."""
    if weights not in WEIGHTS:
        raise InputError(f"weights={weights!r} is not a choice (fp32: dequantized; native: a GGUF file's own formats; "
                         f"or a format to quantize to: {', '.join(FORMATS)})")  # fmt: skip


def load_for_eval(path: str | Path, data_dir: str | None = None, tag: str = "best", device=None,
                  weights: str = "fp32", activations: str = "fp32") -> EvalModel:  # fmt: skip
    """Loads a model reference: a run directory (its best checkpoint, else last), a checkpoint folder, a .gguf file,
    a Hugging Face folder or hf:ORG/NAME. A run's tokenizer comes from its `tokenizer/` folder, else from the
    prepared data of its data config; a pretrained model's from its own files. weights (WEIGHTS): fp32, native
    (a GGUF file's F16/Q8_0/Q4_0/Q4_1 matrices kept as stored), or fp16/q8_0/q4_0/q4_1 (any model's linear layers
    and embedding quantized after loading). activations: fp32, or q8 (attnlab.set_activations: llama.cpp's 8-bit
    activations for the quantized layers; not exact)."""
    check_weights_choice(weights)
    if weights == "native":  # (said in the command's flags: load_reference says it in the Python API's words)
        kind = resolve(path, data_dir)[0]
        if kind != "gguf":
            what = {"run": "an attnlab run or checkpoint", "hf": "a Hugging Face folder", "hub": "a Hub model"}[kind]
            raise InputError(f"--weights native keeps a GGUF file's own quantized matrices; {path} is {what}: give "
                             f"--weights {', '.join(FORMATS[:-1])} or {FORMATS[-1]} to quantize it after loading, "
                             "or leave --weights out")  # fmt: skip
    loaded = load_reference(path, data_dir=data_dir, tag=tag, weights="native" if weights == "native" else "fp32")
    model = loaded.model if device is None else loaded.model.to(device)
    if weights in FORMATS:
        model = quantize_weights(model, weights)
    if activations != "fp32":
        try:
            set_activations(model, activations)
        except InputError as e:
            raise InputError(f"--activations {activations}: {e} (given --weights {weights})") from None
    return EvalModel(loaded.label, Path(path), loaded.cfg, model, loaded.tokenizer, loaded.config, weights)
