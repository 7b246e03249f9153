"""`GraphedDecode`: one decode step of a whole patched model (embeddings to logits, every layer) captured in one
CUDA graph and replayed per token.

The captured call is `model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)` on static
(B, 1) int64 inputs, no attention mask (every decode token is real: a left-padded batch is a batch of sequences
of different lengths, which the cache holds as its device lengths). What a replay assumes:

* the cache is the one captured with, a `LowbitPagedCache` (or a cache with the same protocol: `batch_size`,
  `snapshot` / `restore`, `advance`, per-layer device `lengths`), and its tensors (pages, block table, lengths)
  are never reallocated: the graph reads and grows them in place, so new per-sequence lengths (`set_lengths`, a
  prefill, earlier steps) are seen by the next replay;
* the host side of the step (the `max_cache_len` check and the timeline counter behind `get_seq_length`) does not
  run inside the graph: `step` calls `cache.advance(1)` before each replay, and raises before replaying a step
  that does not fit;
* nothing in the step syncs the host or depends on tensor values on the host: no attention mask (the mask
  function and the attention function see None and skip their value checks), positions on the device, the decode
  attention's split count from static sizes; the ops' value checks are off (LOWBIT_CHECK_INDICES unset);
* the logits returned by `step` are the graph's static output: the next `step` overwrites them (clone to keep).

Capture: `warmup` eager steps on a side stream (first-call compilation, autotuning and the ops' launch plans
happen there), then the capture. Both run the real forward, which writes each sequence's next key slot and grows
the lengths: the cache's state is snapshotted before and restored after each, so capturing leaves the cache as
it found it (the slots written past each sequence's length are read by no one and rewritten by the first step).
Hence a capture needs room for one more position (`max_cache_len` > the host counter).

`mode="eager"` runs the same step (static inputs, the same bookkeeping seen from the caller) as a plain forward
without a graph, on any device: the reference a replay is checked against, and the CPU-testable path. It is a
mode the caller names, never a fallback: `mode="cuda_graph"` on a cache not on a CUDA device raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

MODES = ("cuda_graph", "eager")
CACHE_PROTOCOL = ("batch_size", "snapshot", "restore", "advance", "layers")


class GraphDecodeError(ValueError):
    """A use of GraphedDecode it does not support (argument, reason)."""


class GraphedDecode:
    """`step(input_ids, position_ids=None) -> logits (B, vocab)` for one token per sequence of `cache`'s batch.

    model: a patched model (`lowbit_patch`) in eval mode. cache: a `LowbitPagedCache` of batch B whose sequences
    hold their context (a prefill through the model, or `set_lengths` after `write_prefix` / `fill_random`).
    position_ids: (B,) or (B, 1) RoPE positions of the new tokens; None takes each sequence's stored length (the
    position of a left-padded batch's next token, as transformers numbers it), copied on the device."""

    def __init__(self, model: torch.nn.Module, cache, *, mode: str = "cuda_graph", warmup: int = 2):
        missing = [name for name in CACHE_PROTOCOL if not hasattr(cache, name)]
        if missing:
            raise GraphDecodeError(f"GraphedDecode: argument 'cache': {type(cache).__name__} lacks "
                                   f"{', '.join(missing)} (pass a LowbitPagedCache)")
        if mode not in MODES:
            raise GraphDecodeError(f"GraphedDecode: argument 'mode': {mode!r} is not one of {', '.join(MODES)}")
        device = cache.layers[0].lengths.device
        if mode == "cuda_graph" and device.type != "cuda":
            raise GraphDecodeError(f"GraphedDecode: argument 'mode': 'cuda_graph' needs the cache on a CUDA device, "
                                   f"it is on {device} (mode='eager' runs the step without a graph)")
        if warmup < 1:
            raise GraphDecodeError(f"GraphedDecode: argument 'warmup': must be >= 1, got {warmup}")
        self.model, self.cache, self.mode = model, cache, mode
        self.batch_size = cache.batch_size
        self.input_ids = torch.zeros((self.batch_size, 1), dtype=torch.long, device=device)
        self.position_ids = torch.zeros((self.batch_size, 1), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        if mode == "cuda_graph":
            self._capture(warmup)

    def _forward(self) -> Tensor:
        out = self.model(input_ids=self.input_ids, position_ids=self.position_ids, past_key_values=self.cache,
                         use_cache=True)
        return out.logits[:, -1]

    def _capture(self, warmup: int) -> None:
        state = self.cache.snapshot()
        self.cache.advance(1)  # the room check a step makes: raises before anything runs
        self.cache.restore(state)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(warmup):
                self._forward()
                self.cache.restore(state)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self.cache.restore(state)

    def _static(self, name: str, value: Tensor, static: Tensor) -> None:
        if not isinstance(value, Tensor) or value.numel() != self.batch_size or value.dim() > 2:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise GraphDecodeError(f"GraphedDecode.step: argument '{name}': expected ({self.batch_size},) or "
                                   f"({self.batch_size}, 1) token positions / ids, got {shape}")
        static.copy_(value.view(self.batch_size, 1))

    def step(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Run one decode step: the new token of every sequence at its position; returns the logits (B, vocab),
        the graph's static output in mode 'cuda_graph' (overwritten by the next step)."""
        self._static("input_ids", input_ids, self.input_ids)
        if position_ids is None:
            self.position_ids.copy_(self.cache.layers[0].lengths.view(self.batch_size, 1))
        else:
            self._static("position_ids", position_ids, self.position_ids)
        with torch.no_grad():
            if self.graph is None:
                return self._forward()
            self.cache.advance(1)
            self.graph.replay()
        return self.logits

    def greedy(self, first_tokens: Tensor, steps: int) -> tuple[Tensor, list[Tensor]]:
        """`steps` greedy steps from `first_tokens` (B,) (each sequence's last token, not yet in the cache):
        returns the tokens (B, steps) chosen and each step's logits (copies)."""
        tokens, logits = [], []
        token = first_tokens.reshape(self.batch_size)
        for _ in range(steps):
            out = self.step(token).clone()
            token = out.argmax(dim=-1)
            tokens.append(token)
            logits.append(out)
        return torch.stack(tokens, dim=1), logits
