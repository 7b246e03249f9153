"""lowbit ops in transformers models: `lowbit_patch(model)` swaps them in, in place (docs/models.md).
transformers is imported only when a patch registers the "lowbit" attention implementation, or when
`LowbitPagedCache` / `LowbitMlaCache` (transformers Cache subclasses) are first looked up."""

from .attention import UnsupportedMaskError, lowbit_attention_forward
from .graph import GraphDecodeError, GraphedDecode
from .patch import (
    PatchReport,
    UnsupportedModelError,
    lowbit_patch,
    patch_deepseek_v3,
    patch_deepseek_v32,
    patch_gpt_oss,
    patch_llama,
    patch_qwen3_moe,
)

__all__ = ["GraphDecodeError", "GraphedDecode", "LowbitMlaCache", "LowbitPagedCache", "PagedCacheError",
           "PatchReport", "UnsupportedMaskError", "UnsupportedModelError", "lowbit_attention_forward", "lowbit_patch",
           "patch_deepseek_v3", "patch_deepseek_v32", "patch_gpt_oss", "patch_llama", "patch_qwen3_moe"]


def __getattr__(name: str):
    if name in ("LowbitPagedCache", "PagedCacheError"):
        from . import paged_cache

        return getattr(paged_cache, name)
    if name == "LowbitMlaCache":
        from . import mla_cache

        return mla_cache.LowbitMlaCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
