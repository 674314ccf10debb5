"""The torch engine: the `Engine` protocol on this library's runtime (`draftexpert.runtime.model`).

Target and drafter are one `MoEModel`; the drafter is a `DraftPath` of its weights (shared+top-r,
or DraftExpert with its draft expert fused into the shared MLP). The routed experts come through
the model's `ExpertStore` (resident, host for cg, flash for mn), so every load is the store's and
every count the store's ledger's. A round is the store's block (`begin_block` / `end_block`):
experts moved during it stay until it ends, so a cold verifier reuses what the drafter or a
prefetch moved; nothing outlives it unless the store's LRU cache keeps it.
"""

from __future__ import annotations

import torch

from draftexpert.decoding import Key
from draftexpert.runtime.model import KVCache, MoEModel
from draftexpert.speculation.drafters import DraftPath


def layer_experts(routing: dict[int, torch.Tensor], rows: slice = slice(None)) -> set[Key]:
    """{(layer, expert)} over the given token rows of a routing tap (layer → [T, k]), read back to
    the host once for all layers (not one sync per layer)."""
    if not routing:
        return set()
    layers = list(routing)
    picked = torch.stack([routing[layer][rows].flatten() for layer in layers])  # [L, rows·k]
    return {(layers[j], e) for j, row in enumerate(picked.tolist()) for e in row}


class TorchEngine:
    def __init__(
        self,
        model: MoEModel,
        path: DraftPath | None = None,
        draft_cache: str = "shared",
        drafters: dict[str, DraftPath] | None = None,
    ):
        """`drafters`: several draft paths a round chooses among (`select_drafter`; `--method auto`),
        over the shared cache (each drafter attends to the target's K/V: switching costs nothing)."""
        if draft_cache not in ("shared", "own"):
            raise ValueError(f"draft_cache must be 'shared' or 'own', got {draft_cache!r}")
        if drafters:
            if draft_cache != "shared":
                raise ValueError("several drafters share the target's cache: draft_cache must be 'shared'")
            path = path or next(iter(drafters.values()))
        self.drafters = dict(drafters or {})
        self.model, self.path, self.own_cache = model, path, draft_cache == "own"
        self.context_length = model.cfg.max_positions  # the KV cache is sized per sequence, up to this
        self.store, self.ledger = model.experts, model.experts.ledger
        self.name = path.name if path is not None else "ar"
        self.cache = self.draft_cache = None

    def start(self, capacity: int) -> None:
        self.ledger.reset()
        self.ledger.start_resident(self.store.resident_keys())  # an LRU cache outlives a sequence
        n = min(self.context_length, capacity)
        self.cache = KVCache.for_model(self.model, n)
        self.draft_cache = KVCache.for_model(self.model, n) if self.own_cache else self.cache
        paths = list(self.drafters.values()) or ([] if self.path is None else [self.path])
        self.model.warm_compiled(self.cache.max_len, [None, *paths])

    def select_drafter(self, name: str) -> None:
        """The draft path the next draft forwards run (one of `drafters`)."""
        self.path = self.drafters[name]

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.model.forward(torch.tensor(ids), self.cache, phase="prefill")[-1]

    def prefill_draft(self, ids: list[int]) -> None:
        if self.draft_cache is not self.cache:
            self.model.forward(torch.tensor(ids), self.draft_cache, phase="prefill-draft", path=self.path)

    def decode_one_token(self, token: int) -> torch.Tensor:
        return self.model.forward(torch.tensor([token]), self.cache, phase="ar")[-1]

    @property
    def draft_length(self) -> int:
        return self.draft_cache.length

    def draft_lengths(self) -> dict[str, int]:
        return dict.fromkeys(self.drafters, self.draft_cache.length)  # one shared cache: none lags

    def draft_forward(self, ids: list[int]) -> torch.Tensor:
        return self.model.forward(torch.tensor(ids), self.draft_cache, phase="draft", path=self.path)[-1]

    def draft_ran(self) -> set[Key]:
        return {(layer, e) for layer, es in self.model.last_fetched.items() for e in es}

    def predicted(self) -> set[Key]:
        return layer_experts(self.model.last_routing, slice(-1, None))  # the draft router's top-k, last token

    def resident(self) -> set[Key]:
        return self.store.resident_keys()

    def prefetch(self, keys: set[Key]) -> set[Key]:
        issued = set()
        for layer in sorted({layer for layer, _ in keys}):
            issued |= {(layer, e) for e in self.store.prefetch(layer, sorted(e for l2, e in keys if l2 == layer))}
        return issued

    def verify(self, start: int, ids: list[int]) -> torch.Tensor:
        self.cache.crop(start)
        return self.model.forward(torch.tensor(ids), self.cache, phase="verify")

    def routed(self) -> set[Key]:
        return layer_experts(self.model.last_routing)

    def commit(self, length: int) -> None:
        self.cache.crop(length)
        if self.draft_cache is not self.cache:
            self.draft_cache.crop(min(self.draft_cache.length, length))

    def begin_round(self) -> None:
        self.store.begin_block()

    def end_round(self) -> None:
        self.store.end_block()

    def stats(self) -> dict:
        return {"ledger": self.ledger.summary()}

    def close(self) -> None:
        self.store.close()
