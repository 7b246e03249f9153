"""lowbit ops in transformers models: `lowbit_patch(model)` swaps them in, in place (docs/models.md).
transformers is imported only when a patch registers the "lowbit" attention implementation."""

from .attention import UnsupportedMaskError, lowbit_attention_forward
from .patch import PatchReport, UnsupportedModelError, lowbit_patch, patch_deepseek_v3, patch_gpt_oss, patch_llama

__all__ = ["PatchReport", "UnsupportedMaskError", "UnsupportedModelError", "lowbit_attention_forward",
           "lowbit_patch",
           "patch_deepseek_v3", "patch_gpt_oss", "patch_llama"]
