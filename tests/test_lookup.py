"""Prompt lookup (`--method pld`): the n-gram proposal on hand-made sequences, and its tokens through
the exact round equal AR offload's on every store (greedy) and follow the target's distribution
(sampled); it drafts with no forward and reads no expert for drafting."""

import pytest
import torch

from bench.cells.cell import Cell, CellError, build
from draftexpert.engines.torch_engine import TorchEngine
from draftexpert.runtime.model import KVCache, from_hf_model
from draftexpert.speculation.lookup import Lookup, lookup
from draftexpert.speculation.round import SpecConfig, SpeculativeDecoder
from tests.test_speculative import ar_tokens, chi2_p, hf_model, models, odirect_dir, prompt  # noqa: F401 - fixtures


def test_longest_ngram_first_and_most_recent_match():
    #         0  1  2  3  4  5  6  7  8  9
    ctx = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert lookup(ctx, 3, max_ngram=3) == [8, 2, 5]  # "5 6" last seen at 4 (not at 0): the most recent
    assert lookup(ctx, 1, max_ngram=3) == [8]
    assert lookup([1, 2, 3, 9, 1, 2, 3], 2, max_ngram=3) == [9, 1]  # the 3-gram wins over shorter ones
    assert lookup([1, 2, 3, 9, 4, 2, 3], 2, max_ngram=3) == [9, 4]  # falls back to the 2-gram "2 3"
    assert lookup([1, 2, 3, 9, 4, 2, 3], 2, max_ngram=3, min_ngram=3) == []
    assert lookup([1, 2, 3, 4], 4) == []  # nothing repeats
    assert lookup([7, 7, 7], 4, max_ngram=2) == [7]  # a run overlapping its own suffix continues
    assert lookup([3], 4) == [] and lookup([], 4) == []
    with pytest.raises(ValueError):
        Lookup(max_ngram=0)


def repeating(seed: int, n: int) -> list[int]:
    """A prompt that repeats itself, so that lookup finds something to propose."""
    base = prompt(seed, n)
    return base + base[: n // 2] + base


@pytest.mark.parametrize("store", ["resident", "host", "flash"])
def test_pld_greedy_equals_ar_offload(models, store):  # noqa: F811 - the fixture
    model = models[1][store]
    drafted = accepted = 0
    for k in (1, 4, 10):
        for ngram in (1, 3):
            for seed in range(3):
                ids = repeating(seed, 8)
                if store != "resident":
                    model.experts.cache.clear()
                ref = ar_tokens(model, ids)
                dec = SpeculativeDecoder(
                    TorchEngine(model), SpecConfig(k_max=k, truncate=False, prefetch=False), lookup=Lookup(ngram)
                )
                out = dec.generate(ids, 24)
                assert out.tokens == ref, (store, k, ngram, seed)
                s = out.stats
                drafted, accepted = drafted + s["drafted"], accepted + s["accepted"]
                assert s["draft_unique"] == 0 and s.get("draft_forwards", 0) == 0  # no draft forward
                assert s.get("prefetch_issued", 0) == 0
    assert drafted > 0, "lookup must propose, or nothing is tested"
    # A random model seldom repeats its prompt, so the accepted path is driven by a proposer that
    # knows AR's continuation and gets every third token wrong: the round must still emit AR's tokens.
    for seed in range(3):
        ids = repeating(seed, 8)
        ref = ar_tokens(model, ids)
        out = SpeculativeDecoder(TorchEngine(model), SpecConfig(k_max=5), lookup=Flawed(ids, ref)).generate(ids, 24)
        assert out.tokens == ref
        drafted, accepted = drafted + out.stats["drafted"], accepted + out.stats["accepted"]
    assert 0 < accepted < drafted, "proposals must be both accepted and rejected, or nothing is tested"


class Flawed:
    """A proposer with AR's own continuation, every third proposed token wrong."""

    def __init__(self, prompt_ids, ref):
        self.full, self.n = prompt_ids + ref, len(prompt_ids)

    def propose(self, context, k):
        nxt = self.full[len(context) : len(context) + k]
        return [t if (len(context) + i) % 3 else (t + 1) % 300 for i, t in enumerate(nxt)]


def test_pld_sampling_matches_the_target_distribution():
    """Vocabulary of 6, a prompt whose 2-gram suffix recurs (lookup proposes every round): tokens 2-3
    of 1,200 sampled runs against the target's exact joint distribution; emitting the lookup's
    proposals unchecked fails the same test."""
    hf = hf_model("v2", vocab_size=6)
    model = from_hf_model(hf)
    ids, T, N = [1, 4, 2, 3, 1, 4], 1.0, 1200  # the unchecked control fails at p < 1e-300 here

    def dist(prefix):
        return torch.softmax(model.forward(torch.tensor(prefix), KVCache.for_model(model, 12))[-1] / T, -1)

    p0, exact = dist(ids), {}
    for a in range(6):
        p1 = dist(ids + [a])
        for b in range(6):
            p2 = dist(ids + [a, b])
            for c in range(6):
                exact[(b, c)] = exact.get((b, c), 0.0) + float(p0[a] * p1[b] * p2[c])
    cells = sorted(exact)
    counts, unchecked = dict.fromkeys(cells, 0), dict.fromkeys(cells, 0)
    dec = SpeculativeDecoder(TorchEngine(model), SpecConfig(k_max=2), lookup=Lookup(2))
    for seed in range(N):
        dec.cfg = SpecConfig(k_max=2, truncate=False, prefetch=False, temperature=T, seed=seed)
        toks = dec.generate(ids, 3).tokens
        counts[tuple(toks[1:3])] += 1
        proposal = Lookup(2).propose(ids + toks[:1], 2)  # negative control: the proposal as emitted
        if len(proposal) == 2:
            unchecked[tuple(proposal)] += 1
        else:
            unchecked[tuple(toks[1:3])] += 1
    expected = [exact[c] * N for c in cells]
    assert chi2_p([counts[c] for c in cells], expected) > 1e-3
    assert chi2_p([unchecked[c] for c in cells], expected) < 1e-6


def test_pld_cell_settings_and_rules():

    cell, _ = build({"method", "pld_tokens"}, method="pld", pld_tokens=6, k_max=4)
    conf = cell.round_config()
    assert (conf.k_max, conf.truncate, conf.prefetch) == (6, False, False)
    assert cell.speculative and cell.label == "pld" and cell.spec.lookup() == Lookup(3)
    args = cell.method_args()
    assert args["drafter"] == "prompt lookup" and args["pld_tokens"] == 6 and "tau" not in args
    with pytest.raises(CellError, match="--tau does not apply to --method pld"):
        build({"method", "tau"}, method="pld", tau=0.5)
    with pytest.raises(CellError, match="--pld-tokens does not apply to --method draftexpert"):
        build({"method", "pld_tokens"}, method="draftexpert", pld_tokens=4)
    with pytest.raises(CellError, match="--pld-max-ngram is at least 1"):
        build({"method", "pld_max_ngram"}, method="pld", pld_max_ngram=0)
    # the other methods' keys are what they were before prompt lookup existed
    assert not {"drafter", "pld_tokens", "pld_max_ngram"} & set(Cell(method="draftexpert").method_args())
    assert Cell(method="pld", engine="llama.cpp").method_args()["drafter"] == "prompt lookup"
