"""The engines' AR on platform mn side by side (`bench speed engines`): decode ms/token of the torch
engine (checkpoint head and `--head-type q4_0`) and llama.cpp over one Q4_0 expert file, each beside
its resident bound, from interleaved rounds — the two fair-baseline targets (torch / llama.cpp ≤ 1.5×,
llama.cpp AR ≥ 0.6× its resident speed) and the paper's own AR / resident on MN (10.18 / 14.36 TPS).
Pure: formats what the benchmark measured."""

from __future__ import annotations

from paper_figs import paper


def table(res: dict) -> str:
    ms, stall = res["ms_per_token"], res["stall_ms_per_token"]
    rows = [
        "| engine | AR ms/token, median (min–max) | stall ms/token | resident ms/token | AR speed / resident "
        "| × llama.cpp's AR ms/token | limit tok/s | tokens equal the resident bound's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e, r in res["resident_of"].items():
        a, limit = ms[e], res["limit_tps"][e]
        rows.append(
            f"| {e} | {a['median']:.2f} ({a['min']:.2f}–{a['max']:.2f}) | {stall[e]['median']:.2f} | "
            f"{ms[r]['median']:.2f} | {res['ar_vs_resident_speed'][e]:.2f} | {res['x_llama_cpp'][e]:.2f} | "
            f"{f'{limit:.0f}' if limit else '–'} | {res['ar_tokens_equal_resident'][e]} |"
        )
    ar, resident = paper.TABLE2[("ds", "mn")]["ar"], paper.RESIDENT_MN_DS_TPS
    f = res["tokens_following_llama_cpp"]
    bw = f"{res['read_bw'] / 1e9:.2f} GB/s, O_DIRECT" if res["read_bw"] else "not measured"
    return "\n".join(rows) + (
        f"\n\nLimit = the storage's measured read bandwidth ({bw}) ÷ bytes moved per token: tokens/s with free "
        f"compute. The paper (DS, MN, llama.cpp): AR / resident speed {ar / resident:.2f} ({ar} / {resident} TPS). "
        "Fair-baseline targets: torch ≤ 1.5× llama.cpp's AR ms/token; llama.cpp AR ≥ 0.6× its resident speed. The "
        f"torch engine's tokens follow llama.cpp's for {f['checkpoint head']:.1f} tokens on average with the "
        f"checkpoint's head and {f['Q4_0 head']:.1f} with the Q4_0 head (of {res['max_new_tokens']}): llama.cpp's "
        "model quantises every matrix, the Q4_0 head all but attention's."
    )
