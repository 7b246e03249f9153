"""Multi-rank compositions over torch.distributed: the expert-parallel MoE layer (docs/ep.md)."""

from .ep_moe import (
    COMBINES,
    DECODE_STAGES,
    PREFILL_STAGES,
    EPDecodeOutput,
    ExchangeSizes,
    ExpertPlacement,
    StageHook,
    ep_moe_decode,
    ep_moe_prefill,
    exchange_rows,
    exchange_sizes,
    message_row_bytes,
    placement,
)

__all__ = ["COMBINES", "DECODE_STAGES", "PREFILL_STAGES", "EPDecodeOutput", "ExchangeSizes", "ExpertPlacement",
           "StageHook", "ep_moe_decode", "ep_moe_prefill", "exchange_rows", "exchange_sizes", "message_row_bytes",
           "placement"]
