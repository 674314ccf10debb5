"""Figs. 4–5: what one verify forward costs as its block grows — the sweep behind the paper's
"verification is not free when experts are offloaded".

For each prompt the target first decodes `context` greedy tokens (AR, the text a speculation
round would have committed); then, for each block length L and each start s, the cache is rebuilt
to prompt + continuation[:s], the expert store emptied (cold, as at a round's start), and one
target forward over continuation[s:s+L] is timed by the ledger (phase `verify`):
  unique(L)  = Σ_l |∪ top-k over the block|          (Eq. 2, |U(B)|; L = 1 is an AR step's k · layers)
  loads(L)   = experts loaded on demand (= unique when cold)
  cost(L)    = wall seconds of the forward / those of the L = 1 forward at the same start
Records are one row per (prompt, start, L); the figure's curves are means over them.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def verify_sweep(model, prompts: list[list[int]], lengths: list[int], starts: list[int],
                 log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> list[dict]:
    from draftexpert.runtime.model import KVCache

    store, ledger = model.experts, model.experts.ledger
    context = max(starts) + max(lengths)
    rows = []
    for p, ids in enumerate(prompts):
        cache = KVCache.for_model(model, len(ids) + context + 1)
        logits = model.forward(torch.tensor(ids), cache, phase="prefill")[-1]
        cont = [int(logits.argmax())]
        while len(cont) < context:
            cont.append(int(model.forward(torch.tensor(cont[-1:]), cache, phase="ar")[-1].argmax()))
        for s in starts:
            for L in lengths:
                cache.crop(len(ids) + s)
                store.cache.clear()
                model.forward(torch.tensor(cont[s:s + L]), cache, phase="verify")
                rec = ledger.forwards[-1]
                rows.append({"prompt": p, "start": s, "length": L, "unique": rec.requested, "loads": rec.loads,
                             "bytes": rec.bytes, "wall_s": rec.wall_s, "stall_s": rec.stall_s})
        log(f"prompt {p + 1}/{len(prompts)}: swept L = {lengths[0]}…{lengths[-1]} at {len(starts)} starts")
    return rows
