"""KV policies and the storage codec of each cached tensor (attnlab.cache.quantized stores with them).

A policy names a format per cached tensor plus a full-precision residual window:

    policy "ksem=q4_0,kgeo=q8_0,v=q4_0,resid=128"   (decoupled: K_sem in Q4_0, K_geo in Q8_0, V in Q4_0,
                                                      the newest 128 tokens kept at full precision)

A Codec encodes a tensor's rows (a token's values over all its KV heads) into storage arrays and back.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from attnlab import quant
from attnlab.errors import ConfigError, InputError
from attnlab.kernels import cpu as cpu_kernels

FLOAT_FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FORMAT_OF_DTYPE = {dtype: name for name, dtype in FLOAT_FORMATS.items()}  # a cache dtype's format name
BLOCK_FORMATS = quant.FORMATS  # q8_0, q4_0, nf4: blocks of 32 with an fp16 scale
KIVI_FORMATS = {"kivi2": 2, "kivi4": 4, "kivi8": 8}  # asymmetric ints: keys per channel, values per token
FORMATS = (*FLOAT_FORMATS, *BLOCK_FORMATS, *KIVI_FORMATS)

KEY_PARTS = ("k_sem", "k_geo", "k1", "k2")  # the key fields a policy's `k` covers (DBA's two paths, DIFF's halves)
ALIASES = {"ksem": "k_sem", "kgeo": "k_geo", "krope": "k_rope"}  # short policy key -> cached tensor name
SHORT = {name: short for short, name in ALIASES.items()}
# Every tensor name a variant's cache layout declares (attention/*.py); a policy key outside them is a typo.
TENSOR_NAMES = ("k", "v", *KEY_PARTS, "k_rope", "latent")
MAX_TOKENS = 2**31 - 1  # a policy's resid, group and flush: token counts the kernels take as C ints


def default_format(dtype: torch.dtype, policy) -> str:
    """The format a KV policy leaves a cache's unnamed tensors in (its residual window's dtype too): the cache dtype's.
    InputError for a dtype no format stores (float64)."""
    if dtype not in FORMAT_OF_DTYPE:
        dtypes = ", ".join(str(d).removeprefix("torch.") for d in FORMAT_OF_DTYPE)
        raise InputError(f"kv policy {policy} needs a cache of {dtypes} values, not {dtype} (a {dtype} model: load it "
                         "with dtype=torch.float32, or leave the policy out)")  # fmt: skip
    return FORMAT_OF_DTYPE[dtype]


def _noun(name: str) -> str:
    noun = "latent keys and values" if name == "latent" else "values" if name == "v" else "keys"
    return f"{noun} ({SHORT.get(name, name)})"


def _holds(fmt: str, limit: float) -> str:
    return (
        f"{fmt} holds (|x| <= {limit:.3g})" if fmt == "fp16" else f"{fmt}'s fp16 block scale holds (|x| <= {limit:.3g})"
    )


class KVValueError(InputError):
    """A K or V value a KV cache's format cannot store: not finite, or beyond what its fp16 block scale holds (a
    block format), or beyond fp16's range (an fp16 cache: a finite value that would become inf).
    One line, for a CLI user too: the policy and the layer (once known: `at`), the cached tensor (`fields`: (name,
    format, limit) of each it may be in, one where known), `bad` values not finite or the largest |value| `peak` (where
    known), and what to do. Raised by the eager step (Codec.encode) and by the fused one (attnlab.model.fused)."""

    LEAVE = "leave the KV policy out (--kv-policy, kv_policy)"

    def __init__(self, fields, bad: int = 0, peak: float | None = None, layer: int | None = None, policy=None,
                 leave: str = LEAVE):  # fmt: skip
        self.fields, self.bad, self.peak, self.layer, self.policy = list(fields), bad, peak, layer, policy
        self.leave = leave  # the way out that drops the policy, in the caller's words
        head = "kv policy: " if policy is None else f"kv policy {policy}: "
        where = "the model's" if layer is None else f"layer {layer}'s"
        formats = " or ".join(dict.fromkeys(fmt for _, fmt, _ in self.fields))
        scales = " or ".join(dict.fromkeys(_holds(fmt, limit) for _, fmt, limit in self.fields))
        names = ", ".join(SHORT.get(name, name) for name, _, _ in self.fields)
        only_fp16 = {fmt for _, fmt, _ in self.fields} == {"fp16"}  # (fp16 stores NaN and inf: only range is refused)
        example = ",".join(f"{SHORT.get(name, name)}=bf16" for name, _, _ in self.fields)
        if isinstance(policy, KVPolicy):  # the policy with bf16 for the tensors named
            failing = {name for name, _, _ in self.fields}
            failing |= {"k"} if failing & set(KEY_PARTS) else set()
            if only_fp16:  # every fp16 tensor: the others may overflow next
                failing |= {name for name, fmt in policy.formats if fmt == "fp16"}
            example = str(dataclasses.replace(policy, formats=tuple(
                (name, "bf16" if name in failing else fmt) for name, fmt in policy.formats)))  # fmt: skip
        fix = (f"store them in a format with more range (bf16 or fp32, e.g. {example}; fp16 stops at 65504), {leave}, "
               "or check the checkpoint (its activations are out of range)")  # fmt: skip
        if bad:
            text = (f"{where} {_noun(self.fields[0][0])} hold {bad} values that are not finite (NaN or inf), which "
                    f"{formats} cannot store: check the checkpoint (a diverged model computes NaN or inf) and its "
                    "input")  # fmt: skip
        elif peak is not None:
            name = SHORT.get(self.fields[0][0], self.fields[0][0])
            text = (f"{where} {_noun(self.fields[0][0])} reach |{name}|={peak:.3g}, beyond what {scales}: "
                    f"{fix}")  # fmt: skip
        elif only_fp16:
            text = f"{where} keys or values ({names}) hold a value beyond what {scales}: {fix}"
        else:
            text = (f"{where} keys or values ({names}) hold a value that is not finite (NaN or inf), or beyond what "
                    f"{scales}: {fix}")  # fmt: skip
        super().__init__(head + text)

    def at(self, layer: int, policy) -> KVValueError:
        """The same refusal naming the layer and the policy (the model's forward knows them, the codec does not)."""
        return KVValueError(self.fields, self.bad, self.peak, layer, policy, self.leave)

    def instead(self, leave: str) -> KVValueError:
        """The same refusal with another way out (e.g. kv-eval's "leave it out of --policies")."""
        return KVValueError(self.fields, self.bad, self.peak, self.layer, self.policy, leave)


@dataclass(frozen=True)
class KVPolicy:
    """Storage format per cached tensor (unnamed tensors stay in the cache dtype) and the residual window.

    `formats` keeps the order the policy was written in, so `str(KVPolicy.parse(s)) == s` for a
    policy written with the short names (ksem, kgeo, krope) and resid/group last."""

    formats: tuple[tuple[str, str], ...] = ()  # (tensor name or "k", format)
    resid: int = 0  # newest tokens kept at full precision
    group: int | None = None  # KIVI group size (None = 32)
    flush: int = 1  # tokens quantized together once they left the window (up to flush - 1 more wait in full
    # precision): fewer, larger quantize calls per decode step. A cache allocates only whole blocks that can leave
    # (cache.quantized.slot_counts): with a flush longer than the cache, its tokens all stay at full precision

    @classmethod
    def parse(cls, text: str) -> KVPolicy:
        """`"k=q8_0,v=q4_0,resid=128"`; tensor keys: k, v, ksem, kgeo, latent, krope (or their long names)."""
        if not isinstance(text, str):
            raise ConfigError(f"kv policy {text!r} must be a string such as 'k=q8_0,v=q4_0,resid=128'")
        formats, resid, group, flush, problems = [], 0, None, 1, []
        text = text.strip()
        if text in ("", "none", "fp"):
            return cls()
        for item in text.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not item.strip():
                problems.append(f"kv policy {text!r} has an empty item (a comma at its start or end, or two in a "
                                "row): remove the comma")  # fmt: skip
            elif not sep or not key or not value:
                problems.append(f"kv policy item {item!r} must look like name=value (e.g. k=q8_0 or resid=128)")
            elif key in ("resid", "group", "flush"):
                if not re.fullmatch(r"\d+", value):
                    problems.append(f"kv policy {key}={value!r} must be a whole number of tokens")
                elif int(value) > MAX_TOKENS:
                    problems.append(f"kv policy {key}={value} is more tokens than any cache holds: give at most "
                                    f"{MAX_TOKENS:,}")  # fmt: skip
                elif key == "resid":
                    resid = int(value)
                elif key == "group":
                    group = int(value)
                else:
                    flush = int(value)
            elif value not in FORMATS and ALIASES.get(key, key) not in TENSOR_NAMES:
                names = ", ".join(SHORT.get(name, name) for name in TENSOR_NAMES)
                problems.append(f"kv policy {key}={value!r}: {key!r} is not a cached tensor name ({names}, as the "
                                "model caches them) nor resid, group or flush")  # fmt: skip
            elif value not in FORMATS:
                problems.append(f"kv policy {key}={value!r}: unknown format (use one of {', '.join(FORMATS)})")
            else:
                formats.append((ALIASES.get(key, key), value))
        names = [name for name, _ in formats]
        problems += [f"kv policy names {name!r} twice" for name in sorted({n for n in names if names.count(n) > 1})]
        if group is not None and group < 1:
            problems.append(f"kv policy group={group} must be >= 1")
        elif group is not None and not any(fmt in KIVI_FORMATS for _, fmt in formats):
            kivi = ", ".join(KIVI_FORMATS)
            problems.append(f"kv policy group={group} is the group size of the KIVI formats ({kivi}), which no "
                            "tensor of this policy is stored in (leave group out)")  # fmt: skip
        elif group is not None:  # each code packs whole bytes: group * bits a multiple of 8
            for bits in sorted({KIVI_FORMATS[fmt] for _, fmt in formats if fmt in KIVI_FORMATS}):
                if group * bits % 8:
                    step = 8 // math.gcd(8, bits)
                    problems.append(
                        f"kv policy group={group}: a group of kivi{bits} codes must fill whole bytes "
                        f"(group * {bits} a multiple of 8): give a multiple of {step}, e.g. 32 or 128"
                    )
        if flush < 1:
            problems.append(f"kv policy flush={flush} must be >= 1")
        if problems:
            raise ConfigError(list(dict.fromkeys(problems)))  # (each said once: two empty items are one problem)
        return cls(tuple(formats), resid, group, flush)

    def __str__(self) -> str:
        items = [f"{SHORT.get(name, name)}={fmt}" for name, fmt in self.formats]
        items += [f"resid={self.resid}"] if self.resid else []
        items += [f"group={self.group}"] if self.group is not None else []
        items += [f"flush={self.flush}"] if self.flush != 1 else []
        return ",".join(items) or "none"

    def step(self, codecs) -> int:
        """Tokens quantized together: a multiple of every codec's block of tokens and of `flush`."""
        return math.lcm(self.flush, *(codec.tokens_per_block for codec in codecs))

    @property
    def group_size(self) -> int:
        return self.group or 32

    def idle_cause(self, tokens: int) -> tuple[str, str]:
        """(why a cache of `tokens` tokens under this policy stores none of them quantized, what to give instead):
        its residual window holds them all, or the tokens past it fill no KIVI key group or flush."""
        if self.resid >= tokens:
            return f"its residual window (resid={self.resid}) keeps all {tokens} tokens at full precision", \
                "a smaller resid"  # fmt: skip
        grouped = any(name.startswith("k") and fmt in KIVI_FORMATS for name, fmt in self.formats)
        causes = ([f"KIVI stores keys in groups of {self.group_size} tokens (group={self.group_size})"] * grouped +
                  [f"flush={self.flush} quantizes tokens {self.flush} at a time"] * (self.flush > 1))  # fmt: skip
        past = f"the {tokens - self.resid} tokens past its residual window (resid={self.resid})" if self.resid else \
            f"its {tokens} tokens"  # fmt: skip
        fix = " or ".join(["a smaller group"] * grouped + ["a smaller flush"] * (self.flush > 1)) or "a smaller resid"
        return f"{' and '.join(causes) or 'its window'}, and {past} are too few for one", fix

    def format_of(self, tensor: str, default: str) -> str:
        """The format of cached tensor `tensor` (`k` covers k_sem and k_geo, or k1 and k2, unless they are named)."""
        named = dict(self.formats)
        if tensor in named:
            return named[tensor]
        if tensor in KEY_PARTS and "k" in named:
            return named["k"]
        return default

    def check(self, tensors: list[str]) -> None:
        """Raises ConfigError when the policy names a tensor this cache does not hold."""
        known = set(tensors) | ({"k"} if set(tensors) & set(KEY_PARTS) else set())
        unknown = [name for name, _ in self.formats if name not in known]
        if unknown:
            valid = ", ".join(SHORT.get(t, t) for t in tensors)
            raise ConfigError(
                [f"kv policy names {SHORT.get(n, n)!r}, which this model does not cache (use {valid})" for n in unknown]
            )


def policy_type_problem(policy, what: str = "kv policy ") -> str | None:
    """Why `policy` is not a KV policy as given (None, a policy string or a KVPolicy), or None: a list, dict or
    number would fail in the parser on .strip. `what` is said before the value ("kv policy ", "kv_policy=")."""
    if policy is None or isinstance(policy, str | KVPolicy):
        return None
    return (f"{what}{policy!r} must be a policy string such as 'k=q8_0,v=q4_0' (formats per cached tensor, "
            "resid=...) or an attnlab.cache.codecs.KVPolicy")  # fmt: skip


def as_policy(policy: KVPolicy | str | None) -> KVPolicy | None:
    problem = policy_type_problem(policy)
    if problem:
        raise InputError(problem)
    if policy is None or isinstance(policy, KVPolicy):
        return policy
    parsed = KVPolicy.parse(policy)
    return parsed if parsed.formats or parsed.resid else None


class Codec:
    """Encodes rows of one cached tensor, (B, tokens, width) float, into its storage arrays (see `allocate`)
    and back. `tokens_per_block` is 1 except for per-channel (KIVI key) formats."""

    def __init__(self, fmt: str, width: int, is_key: bool, group: int, name: str):
        self.fmt, self.width, self.name = fmt, width, name
        self.per_channel = fmt in KIVI_FORMATS and is_key
        self.tokens_per_block = group if self.per_channel else 1
        if fmt in BLOCK_FORMATS and width % quant.BLOCK:
            raise ConfigError(
                f"kv policy {SHORT.get(name, name)}={fmt}: a token's {name} row has {width} values, not a multiple "
                f"of {quant.BLOCK} (use fp16 or a kivi format for it)"
            )
        if fmt in KIVI_FORMATS and not self.per_channel and width % group:
            raise ConfigError(
                f"kv policy {SHORT.get(name, name)}={fmt}: row of {width} values is not a multiple of group={group}"
            )
        if fmt in FLOAT_FORMATS:
            per_value = FLOAT_FORMATS[fmt].itemsize
        elif fmt in BLOCK_FORMATS:
            per_value = quant.bytes_per_value(fmt)
        else:
            per_value = quant.kivi_bytes_per_value(KIVI_FORMATS[fmt], group)
        self.row_bytes = round(self.tokens_per_block * width * per_value)  # bytes of one block of tokens
        self.group = group

    @property
    def bytes_per_token(self) -> float:
        return self.row_bytes / self.tokens_per_block

    def allocate(self, batch: int, blocks: int, device=None) -> list[torch.Tensor]:
        """Zeroed storage for `blocks` blocks: [bytes (B, blocks, row_bytes)]; block formats keep the quants
        and the fp16 scales of their ggml blocks in two arrays, [quants (B, blocks, nb, 16|32), scales
        (B, blocks, nb, 2)] (the same bytes, contiguous for a fast dequantizer)."""
        if self.fmt in BLOCK_FORMATS:
            nb, quants = self.width // quant.BLOCK, quant.block_bytes(self.fmt) - 2
            return [
                torch.zeros(batch, blocks, nb, quants, dtype=torch.uint8, device=device),
                torch.zeros(batch, blocks, nb, 2, dtype=torch.uint8, device=device),
            ]
        return [torch.zeros(batch, blocks, self.row_bytes, dtype=torch.uint8, device=device)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: (B, n, width) float, n a multiple of tokens_per_block -> storage arrays for n / tokens_per_block
        blocks (see `allocate`). KVValueError for a value the format cannot store."""
        try:
            return self._encode(x)
        except quant.UnstorableError as e:
            raise KVValueError([(self.name, self.fmt, e.limit)], e.bad, None if e.bad else e.peak) from None

    def _encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fmt in FLOAT_FORMATS:
            y = x.to(FLOAT_FORMATS[self.fmt])
            if self.fmt == "fp16" and x.dtype != torch.float16:  # a finite x beyond 65504 becomes inf
                overflow = torch.isinf(y)
                if overflow.any() and (overflow := overflow & torch.isfinite(x)).any():
                    peak = x[overflow].abs().max().item()
                    raise quant.UnstorableError(f"x has values up to |x|={peak:.6g}, beyond fp16's range", 0, peak,
                                                quant.FP16_MAX)  # fmt: skip
            return [y.contiguous().view(torch.uint8)]
        if self.fmt in BLOCK_FORMATS:
            arrays = cpu_kernels.quantize(self.fmt, x) if self.kernel_quantizes(x) else None  # the same bytes,
            if arrays is not None:  # without ~20 small torch ops
                return arrays
            blocks = quant.quantize(x, self.fmt).unflatten(-1, (-1, quant.block_bytes(self.fmt)))  # ggml's bytes
            return [blocks[..., 2:], blocks[..., :2]]
        return [quant.quantize_kivi(x, KIVI_FORMATS[self.fmt], self.group, self.per_channel)]

    def encode_into(self, x: torch.Tensor, arrays: list[torch.Tensor], start: int) -> None:
        """`encode(x)` written into storage arrays (see `allocate`) at blocks start.. (block formats straight from
        the C quantizer)."""
        if self.kernel_quantizes(x) and cpu_kernels.quantize_into(self.fmt, x, arrays, start):
            return
        for array, values in zip(arrays, self.encode(x), strict=True):
            array[:, start : start + values.shape[1]] = values

    def kernel_quantizes(self, x: torch.Tensor) -> bool:
        """Whether the C quantizer (attnlab.kernels.cpu) takes rows x of this format."""
        return (
            self.fmt in BLOCK_FORMATS
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.stride(-1) == 1
            and cpu_kernels.available()
        )

    def ggml_bytes(self, stored: list[torch.Tensor]) -> torch.Tensor:
        """Block formats: the stored arrays as ggml's bytes, (B, n, nb * block_bytes) (what quant.quantize gave)."""
        quants, scales = stored
        return torch.cat((scales, quants), dim=-1).flatten(-2)

    def decode_into(self, stored: list[torch.Tensor], dest: torch.Tensor) -> None:
        """Decodes stored blocks into dest, a token-major view (B, n, H, d) or (B, n, d) with H * d = width and
        any strides, in one pass over the stored bytes where the layout allows (the same values as `decode`,
        bit for bit)."""
        if self.fmt in FLOAT_FORMATS:
            dest.copy_(stored[0].view(FLOAT_FORMATS[self.fmt]).view(dest.shape))
        elif self.fmt in BLOCK_FORMATS and _BlockView.fits(dest):
            dequantize_into(*stored, self.fmt, dest)
        else:
            dest.copy_(self.decode(stored, dest.dtype).view(dest.shape))

    def decode(self, stored: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Stored blocks -> (B, blocks * tokens_per_block, width) in `dtype`."""
        q = stored[0]
        if self.fmt in FLOAT_FORMATS:
            return q.view(FLOAT_FORMATS[self.fmt]).to(dtype)
        if self.fmt in BLOCK_FORMATS:
            return quant.dequantize(self.ggml_bytes(stored), self.fmt).to(dtype)
        return quant.dequantize_kivi(q, KIVI_FORMATS[self.fmt], self.group, self.per_channel, self.width).to(dtype)


class _BlockView:
    """A token-major destination (B, n, H, d) or (B, n, d) seen as blocks of 32 consecutive row values, as a
    view (no copy, any strides), and a (B, n, blocks, k) source shaped to match it."""

    def __init__(self, dest: torch.Tensor):
        self.dest = dest
        if dest.dim() == 3 or dest.shape[-1] % quant.BLOCK == 0:  # blocks inside one head's row
            self.view = dest.unflatten(-1, (-1, quant.BLOCK))  # (B, n, [H,] d/32, 32)
            self.heads = None if dest.dim() == 3 else dest.shape[2]
        else:  # one block spans 32/d heads
            self.view = dest.unflatten(2, (-1, quant.BLOCK // dest.shape[-1]))  # (B, n, nb, 32/d, d)
            self.heads = None

    @staticmethod
    def fits(dest: torch.Tensor) -> bool:
        width = dest.shape[-1]
        return dest.dim() == 3 or width % quant.BLOCK == 0 or quant.BLOCK % width == 0

    def source(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n, nb, k) -> the view's layout; k is 32 (values), 16 (a nibble half) or 1 (the scale)."""
        if self.heads is not None:
            return t.unflatten(2, (self.heads, -1))  # (B, n, H, d/32, k)
        if self.view.dim() == 5:  # (B, n, nb, 32/d, d)
            width = self.dest.shape[-1]
            return t.unsqueeze(-1) if t.shape[-1] == 1 else t.unflatten(-1, (-1, width))
        return t

    def half(self, upper: bool) -> torch.Tensor:
        """Elements 0..15 (or 16..31) of every block."""
        if self.view.dim() == 5 and self.heads is None:
            rows = self.view.shape[-2] // 2
            return self.view[..., rows:, :] if upper else self.view[..., :rows, :]
        return self.view[..., 16:] if upper else self.view[..., :16]


def dequantize_into(quants: torch.Tensor, scales: torch.Tensor, fmt: str, dest: torch.Tensor) -> None:
    """quant.dequantize of ggml blocks, given as their quants (B, n, nb, 32 | 16) and fp16 scale bytes
    (B, n, nb, 2), written into `dest` (same values, bit for bit): dest (B, n, H, d) or (B, n, d) float, any
    strides, with d a multiple or a divisor of 32."""
    scale = scales.view(torch.float16).float()  # (B, n, nb, 1)
    view = _BlockView(dest)
    if fmt == "q8_0":
        torch.mul(view.source(quants.view(torch.int8)), view.source(scale), out=view.view)
        return
    nibbles = quants  # byte j: element j (low nibble) and j + 16 (high nibble)
    # q - 8 for both nibbles with fast int8 ops (uint8 >> is not vectorized): the high nibble h of b ^ 0x80
    # read as a signed 4-bit number is h - 8, and int8 >> 4 sign-extends it.
    low = (nibbles & 15).view(torch.int8) - 8
    high = (nibbles ^ 0x80).view(torch.int8) >> 4
    for upper, codes in ((False, low), (True, high)):
        if fmt == "nf4":  # codebook entry q = code + 8
            table = _nf4_table(dest.device)
            codes = table.index_select(0, (codes + 8).flatten().int()).view(codes.shape)
        torch.mul(view.source(codes), view.source(scale), out=view.half(upper))


_NF4_TABLES: dict = {}


def _nf4_table(device) -> torch.Tensor:
    if device not in _NF4_TABLES:
        _NF4_TABLES[device] = torch.tensor(quant.NF4_CODEBOOK, dtype=torch.float32, device=device)
    return _NF4_TABLES[device]
