"""The ledger: every expert request and load of every forward, tagged by phase.

Per forward (one call of the model on T tokens), with phase ∈ {prefill, ar, draft, verify}:
  requested   unique (layer, expert) pairs the forward's tokens routed to      = Σ_l |U_l(B)| (Eq. 2)
  loads       of those, the ones not on the accelerator and moved there         (cache / in-flight misses)
  hits        requested − loads: already resident, cached, or prefetched
  bytes       bytes read from the expert store for those loads (file bytes on flash: Q4_0 is 4.5 bits/weight)
  stall_s     seconds the forward waited for loads to finish (on CUDA: the compute stream's wait on
              each expert's copy event, timed by CUDA events — the host does not block)
  wall_s      wall seconds of the forward (on CUDA: from a synchronised start to a synchronised end)
  per_layer   the same counters for each MoE layer
Prefetch (speculation; outside any forward):
  issued      loads started by draft-router prefetch                 bytes: their bytes
  hits        issued and used by the round's verification
  waste       issued and not used by it                               = issued − hits
  misses      verifier experts needed, not resident at verify start, not prefetched (loaded on demand)
Oracle (`summary()["oracle"]`, decode requests only): Belady's MIN on the run's trace of requested
  experts with room for `capacity` = the most experts the run held on the accelerator at once while
  decoding (cache ∪ round working set ∪ loads in flight, as the store reports it): the fewest loads any cache
  or prefetcher with that memory could have made (`draftexpert.runtime.oracle`).
Counters only: totals sum them over forwards, `summary()` also splits them by phase; every ratio
(loading share, hit rate, coverage, …) is derived once, in `draftexpert.metrics`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from draftexpert.runtime.oracle import belady_loads

COUNTERS = ("requested", "loads", "hits", "bytes", "stall_s")
PREFETCH_COUNTERS = ("issued", "bytes", "hits", "waste", "misses")


@dataclass
class ForwardRecord:
    phase: str
    tokens: int
    requested: int = 0
    loads: int = 0
    hits: int = 0
    bytes: int = 0
    stall_s: float = 0.0
    wall_s: float = 0.0
    per_layer: dict[int, dict] = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(COUNTERS, 0)))


class Ledger:
    def __init__(self):
        self.forwards: list[ForwardRecord] = []
        self._current: ForwardRecord | None = None
        self.prefetch = dict.fromkeys(PREFETCH_COUNTERS, 0)
        self._sync = None  # the device's synchronize (CUDA), so wall clocks cover the device's work
        self._gpu_waits: list[tuple[int, object, object]] = []  # (layer, needed-at event, copy-done event)
        self.trace: list[tuple[tuple[int, int], ...]] = []  # each layer request of a ledgered forward, in order
        self.trace_decode: list[bool] = []  # whether its forward was a decode one (not a prefill)
        self.peak_resident = 0  # the most experts the store held on the accelerator at once
        self.initial: set[tuple[int, int]] = set()  # what it held when the sequence started

    def use_cuda(self, device) -> None:
        self._sync = lambda: torch.cuda.synchronize(device)

    @contextmanager
    def forward(self, phase: str, tokens: int):
        """Wrap one model forward; expert stores report into it through `record` (and, on CUDA,
        `record_gpu_wait`, settled when the forward's work is done)."""
        rec = ForwardRecord(phase, tokens)
        self._current = rec
        if self._sync:
            self._sync()  # the previous work is not this forward's
        t0 = time.perf_counter()
        try:
            yield rec
        finally:
            if self._sync:
                self._sync()
                self._settle(rec)
            rec.wall_s = time.perf_counter() - t0
            self._current = None
            self.forwards.append(rec)

    def record_gpu_wait(self, layer: int, needed, done) -> None:
        """The compute stream waits on a copy: `needed` recorded on it where it needs the expert,
        `done` on the copy stream when the copy ends (both timing events); stall = done − needed."""
        if self._current is not None:  # as `record`: outside a ledgered forward nothing is counted
            self._gpu_waits.append((layer, needed, done))

    def _settle(self, rec: ForwardRecord) -> None:
        for layer, needed, done in self._gpu_waits:
            stall = max(0.0, needed.elapsed_time(done) / 1e3)
            rec.stall_s += stall
            rec.per_layer[layer]["stall_s"] += stall
        self._gpu_waits.clear()

    def record(self, layer: int, requested: int, loads: int, nbytes: int, stall_s: float, experts=()) -> None:
        """One layer's request: counters, and (`experts`: the ids it computed with) the oracle's trace."""
        rec = self._current
        if rec is None:  # a store used outside a ledgered forward (e.g. a warm-up): not counted
            return
        group = tuple((layer, int(e)) for e in experts)
        if group:
            self.trace.append(group)
            self.trace_decode.append(not rec.phase.startswith("prefill"))
        pl = rec.per_layer[layer]
        for key, val in (
            ("requested", requested),
            ("loads", loads),
            ("hits", requested - loads),
            ("bytes", nbytes),
            ("stall_s", stall_s),
        ):
            setattr(rec, key, getattr(rec, key) + val)
            pl[key] += val

    def start_resident(self, keys) -> None:
        """The experts held when a sequence starts (a cache kept from the sequence before)."""
        self.initial = set(keys)
        self.note_resident(len(self.initial))

    def note_resident(self, experts: int) -> None:
        """The store holds `experts` experts on the accelerator now (the oracle's capacity is the peak over
        decoding: a prefill's one-layer request of nearly every expert is transient, not decode's memory)."""
        if self._current is not None and self._current.phase.startswith("prefill"):
            return
        if experts > self.peak_resident:
            self.peak_resident = experts

    def oracle(self) -> dict | None:
        """Belady's MIN on the decode requests with the run's peak memory (see the module docstring)."""
        if not self.trace or not (any(r.loads for r in self.forwards) or self.prefetch["issued"]):
            return None  # nothing was moved (resident experts): no loading to compare
        return {
            "capacity": self.peak_resident,
            "requested": sum(len(g) for g, d in zip(self.trace, self.trace_decode) if d),
            "loads": belady_loads(self.trace, self.peak_resident, self.trace_decode, self.initial),
        }

    def record_prefetch(self, issued: int, nbytes: int) -> None:
        self.prefetch["issued"] += issued
        self.prefetch["bytes"] += nbytes

    def record_prefetch_outcome(self, hits: int, waste: int, misses: int) -> None:
        self.prefetch["hits"] += hits
        self.prefetch["waste"] += waste
        self.prefetch["misses"] += misses

    def reset(self) -> None:
        self.forwards.clear()
        self.prefetch = dict.fromkeys(PREFETCH_COUNTERS, 0)
        self.trace.clear()
        self.trace_decode.clear()
        self.peak_resident = 0
        self.initial = set()

    def summary(self) -> dict:
        """Totals, by phase, and per-layer totals (counters: see the module docstring)."""

        def agg(recs):
            out = {k: sum(getattr(r, k) for r in recs) for k in (*COUNTERS, "wall_s")}
            out["forwards"] = len(recs)
            out["tokens"] = sum(r.tokens for r in recs)
            return out

        per_layer: dict[int, dict] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
        for r in self.forwards:
            for layer, c in r.per_layer.items():
                for k in COUNTERS:
                    per_layer[layer][k] += c[k]
        phases = sorted({r.phase for r in self.forwards})
        return {
            "total": agg(self.forwards),
            "prefetch": dict(self.prefetch),
            "oracle": self.oracle(),
            "by_phase": {p: agg([r for r in self.forwards if r.phase == p]) for p in phases},
            "per_layer": {str(k): v for k, v in sorted(per_layer.items())},
        }
