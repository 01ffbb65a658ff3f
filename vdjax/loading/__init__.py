"""Loading: registered model names, local checkpoints and Hub ids -> Params and
tokenizers; the compile cache."""

from vdjax.loading.jit_cache import compile_cache
from vdjax.loading.registry import cache_dir, load, load_tokenizer, read_config, resolve

__all__ = ["cache_dir", "compile_cache", "load", "load_tokenizer", "read_config", "resolve"]
