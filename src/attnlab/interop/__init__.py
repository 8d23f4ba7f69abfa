"""Model references in and out: Hugging Face models and folders, GGUF files, llama2.c files.

    cfg, model, tokenizer = load_model(ref)   # a .gguf file, an HF folder, hf:ORG/NAME[@REV], an attnlab run

Modules: `hf` (config.json -> ModelConfig, the one HF-name -> attnlab-tensor table every source fills the
model through, safetensors folders), `gguf` (GGUF metadata and dequantized tensors), `tokenizer` (a
pretrained model's tokenizer, from tokenizer.json or GGUF metadata), `llama2c` (karpathy's llama2.c files),
`references` (load_model).
"""

from attnlab.data.pretrained import PretrainedTokenizer, tokenizer_from_folder
from attnlab.interop.gguf import config_from_gguf, load_gguf, open_gguf
from attnlab.interop.hf import config_from_hf, config_from_hf_llama, from_hf_llama, load_hf_folder
from attnlab.interop.llama2c import decode_llama2c, from_llama2c, load_llama2c_vocab
from attnlab.interop.references import load_model
from attnlab.interop.tokenizer import tokenizer_from_gguf

__all__ = [
    "PretrainedTokenizer",
    "config_from_gguf",
    "config_from_hf",
    "config_from_hf_llama",
    "decode_llama2c",
    "from_hf_llama",
    "from_llama2c",
    "load_gguf",
    "load_hf_folder",
    "load_llama2c_vocab",
    "load_model",
    "open_gguf",
    "tokenizer_from_folder",
    "tokenizer_from_gguf",
]
