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

Fig. 4's dense half sweeps the MoE's dense counterpart (`write_dense_counterpart`: one FFN of the
active routed width per MoE layer, offloaded through the same store) over the same blocks —
the MoE target's continuations — each normalised to its own one-token step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from draftexpert.runtime.model import KVCache


def continuation(model, ids: list[int], context: int):
    """(cache holding the prompt, the model's greedy continuation of `context` tokens)."""
    cache = KVCache.for_model(model, len(ids) + context + 1)
    cont = [int(model.forward(torch.tensor(ids), cache, phase="prefill")[-1].argmax())]
    while len(cont) < context:
        cont.append(int(model.forward(torch.tensor(cont[-1:]), cache, phase="ar")[-1].argmax()))
    return cache, cont


def verify_sweep(
    model,
    prompts: list[list[int]],
    lengths: list[int],
    starts: list[int],
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    continuations: list[list[int]] | None = None,
) -> tuple[list[dict], list[list[int]]]:
    """(rows, the continuations swept): the model's own greedy ones, or `continuations` (another
    model's, e.g. the MoE target's for its dense counterpart)."""
    store, ledger = model.experts, model.experts.ledger
    context = max(starts) + max(lengths)
    rows, swept = [], []
    for p, ids in enumerate(prompts):
        if continuations is None:
            cache, cont = continuation(model, ids, context)
        else:
            cache, cont = KVCache.for_model(model, len(ids) + context + 1), continuations[p][:context]
            model.forward(torch.tensor(ids + cont[:-1]), cache, phase="prefill")  # as `continuation` leaves it
        swept.append(cont)
        for s in starts:
            for L in lengths:
                cache.crop(len(ids) + s)
                store.cache.clear()
                model.forward(torch.tensor(cont[s : s + L]), cache, phase="verify")
                rec = ledger.forwards[-1]
                rows.append(
                    {
                        "prompt": p,
                        "start": s,
                        "length": L,
                        "unique": rec.requested,
                        "loads": rec.loads,
                        "bytes": rec.bytes,
                        "wall_s": rec.wall_s,
                        "stall_s": rec.stall_s,
                    }
                )
        log(f"prompt {p + 1}/{len(prompts)}: swept L = {lengths[0]}…{lengths[-1]} at {len(starts)} starts")
    return rows, swept
