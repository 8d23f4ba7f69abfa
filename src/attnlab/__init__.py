"""attnlab: efficient-attention language models, built, trained and measured honestly.

The names below are imported when first used (PEP 562): `import attnlab` imports no torch, so that the `attnlab`
command's entry point (attnlab.entry, which Python can reach only through this package) holds every import of a
command and says a Ctrl-C during them in one line. `from attnlab import generate` is the function, as before.
"""

import sys as _sys
import types as _types

__version__ = "0.1.0"

_HOMES = {  # each public name: the module that defines it
    "AttnlabError": "attnlab.errors",
    "ConfigError": "attnlab.errors",
    "DataError": "attnlab.errors",
    "InputError": "attnlab.errors",
    "ModelConfig": "attnlab.config",
    "Transformer": "attnlab.model.transformer",
    "build_model": "attnlab.model.transformer",
    "from_hf_llama": "attnlab.interop",
    "generate": "attnlab.generate",
    "kv_report": "attnlab.accounting",
    "load_config": "attnlab.config_io",
    "load_model": "attnlab.interop",
    "model_config_from_dict": "attnlab.config_io",
    "param_counts": "attnlab.accounting",
    "quantize_weights": "attnlab.model.qlinear",
    "set_activations": "attnlab.model.qlinear",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    import importlib

    from attnlab.paths import temporary_directory_problem

    problem = temporary_directory_problem() if home != "attnlab.errors" else None
    if problem:  # importing torch writes a file in the temporary directory (and died in a traceback without one)
        raise ImportError(f"attnlab.{name} cannot be imported: {problem}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule attnlab.generate sets the package's attribute `generate` to it: the public name
        # `generate` stays the function (the eager imports this package once made ended with the function too).
        if name == "generate" and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
