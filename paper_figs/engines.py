"""The engines' AR on platform mn side by side (`bench speed engines`): decode ms/token of the torch
engine (checkpoint head and `--head-type q4_0`) and llama.cpp over one Q4_0 expert file, each beside
its resident bound, from interleaved rounds — #13's two baseline bars (torch / llama.cpp ≤ 1.5×,
llama.cpp AR ≥ 0.6× its resident speed) and the paper's own AR / resident on MN (10.18 / 14.36 TPS).
Pure: formats what the benchmark measured."""
from __future__ import annotations

from paper_figs import paper

OFFLOADED = ("torch", "torch, Q4_0 head", "llama.cpp")
RESIDENT = {"torch": "torch resident", "torch, Q4_0 head": "torch, Q4_0 head, resident",
            "llama.cpp": "llama.cpp resident"}


def table(res: dict) -> str:
    ms, stall = res["ms_per_token"], res["stall_ms_per_token"]
    llama = ms["llama.cpp"]["median"]
    rows = ["| engine | AR ms/token, median (min–max) | stall ms/token | resident ms/token | AR speed / resident "
            "| × llama.cpp's AR ms/token | tokens equal the resident bound's |", "|---|---|---|---|---|---|---|"]
    for e in OFFLOADED:
        a, r = ms[e], ms[RESIDENT[e]]
        rows.append(f"| {e} | {a['median']:.2f} ({a['min']:.2f}–{a['max']:.2f}) | {stall[e]['median']:.2f} | "
                    f"{r['median']:.2f} | {res['ar_vs_resident_speed'][e]:.2f} | {a['median'] / llama:.2f} | "
                    f"{res['ar_tokens_equal_resident'][e]} |")
    paper_ratio = paper.TABLE2[("ds", "mn")]["ar"] / paper.RESIDENT_MN_DS_TPS
    f = res["tokens_following_llama_cpp"]
    return "\n".join(rows) + (
        f"\n\nThe paper (DS, MN, llama.cpp): AR / resident speed {paper_ratio:.2f} (10.18 / 14.36 TPS). Bars (#13): "
        "torch ≤ 1.5× llama.cpp's AR ms/token; llama.cpp AR ≥ 0.6× its resident speed. The torch engine's tokens "
        f"follow llama.cpp's for {f['checkpoint head']:.1f} tokens on average with the checkpoint's head and "
        f"{f['Q4_0 head']:.1f} with the Q4_0 head (of {res['max_new_tokens']}): llama.cpp's model quantises every "
        "matrix, the Q4_0 head all but attention's.")
