"""Multi-rank compositions over torch.distributed: the expert-parallel MoE layer (docs/ep.md)."""

from .ep_moe import EPDecodeOutput, ExpertPlacement, ep_moe_decode, ep_moe_prefill, exchange_rows, placement

__all__ = ["EPDecodeOutput", "ExpertPlacement", "ep_moe_decode", "ep_moe_prefill", "exchange_rows", "placement"]
