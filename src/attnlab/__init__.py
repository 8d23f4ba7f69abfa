"""attnlab: efficient-attention language models, built, trained and measured honestly."""

import tempfile as _tempfile

try:  # importing torch writes a file in the temporary directory
    _tempfile.gettempdir()
except OSError:  # none usable: the names below are left unimported (torch's import would fail with a traceback), so
    # that `attnlab.cli` can say so in one line; asked for here, they say why they are missing

    def __getattr__(name: str):
        if name in __all__:
            from attnlab.paths import temporary_directory_problem

            raise ImportError(f"attnlab.{name} cannot be imported: {temporary_directory_problem()}")
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")

else:
    from attnlab.accounting import kv_report, param_counts
    from attnlab.config import ModelConfig
    from attnlab.config_io import load_config, model_config_from_dict
    from attnlab.errors import AttnlabError, ConfigError, DataError, InputError
    from attnlab.generate import generate
    from attnlab.interop import from_hf_llama, load_model
    from attnlab.model.qlinear import quantize_weights, set_activations
    from attnlab.model.transformer import Transformer, build_model

__version__ = "0.1.0"

__all__ = [
    "AttnlabError",
    "ConfigError",
    "DataError",
    "InputError",
    "ModelConfig",
    "Transformer",
    "build_model",
    "from_hf_llama",
    "generate",
    "kv_report",
    "load_config",
    "load_model",
    "model_config_from_dict",
    "param_counts",
    "quantize_weights",
    "set_activations",
]
