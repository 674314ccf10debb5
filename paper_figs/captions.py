"""The page around each table: a caption naming what was run (model, platform, engine, prompts,
tokens, round settings, threads, machine), then the table. The round settings (K_max, τ, B) are
read from the result's own `spec` block, never restated here; `bench/steps/reproduce.py` runs the
steps and hands each result and its run facts to these functions.
"""

from __future__ import annotations

from paper_figs import engines, fig3, fig45, regime, spec_table


def round_settings(spec: dict) -> str:
    """'K_max = 4, τ = 0.6, B = 24' from a result's spec block (`SpecOptions` as recorded)."""
    return f"K_max = {spec['k_max']}, τ = {spec['tau']:g}, B = {spec['budget']}"


def _draft_experts(res: dict) -> str:
    de = res["methods"]["draftexpert"]["method_args"]["draft_experts"]
    return (
        "untrained (zero: shared + top-1)"
        if de["preset"] == "zero"
        else f"distilled, preset {de['preset']} ({de['file']})"
    )


def spec_compare_page(res: dict, per_suite: int, tokens: int, threads: int, device: str | None = None) -> str:
    """Table 2 / 3 for one model, platform and engine (a `bench compare --set table2` result)."""
    platform, engine = res["platform"], res["engine"]
    bw = (res["limit_read_bw"] or 0) / 1e9
    if platform == "cg":
        where = f"({device or 'cuda'}: experts in page-locked host memory, copied on demand, cold; fp32 compute)"
        bound, limit = f" on the same {device or 'cuda'}", f"the measured copy-in rate ({bw:.1f} GB/s)"
    else:
        where = (
            "(Q4_0 experts from flash with O_DIRECT, whole experts on demand, cold)"
            if engine == "torch"
            else "through llama.cpp (Q4_0 GGUF, experts staged from storage: "
            f"{res['methods']['ar']['method_args']['staging']})"
        )
        bound, limit = "", f"the storage's measured read bandwidth ({bw:.2f} GB/s, O_DIRECT)"
    return (
        f"{res['model']} on {platform} {where}, {per_suite} prompts per suite, "
        f"{tokens} new tokens, greedy, {round_settings(res['spec'])}, {threads} thread; DraftExpert's draft "
        f"experts: {_draft_experts(res)}. `ar-resident`: AR with every expert resident{bound} (the upper bound); "
        f"limit TPS = {limit} ÷ bytes moved per token. {spec_table.ORACLE_NOTE} "
        + (spec_table.memory_note(res) + " " if spec_table.memory_note(res) else "")
        + f"Tokens equal AR: {res['tokens_equal_ar']}.\n\n"
        + spec_table.table(res)
        + "\n"
    )


def table3_page(res: dict, per_suite: int, suites: tuple[str, ...], tokens: int, threads: int) -> str:
    """Table 3 for one model on mn (a `bench compare --set table3` result)."""
    return (
        f"{res['model']} on mn (Q4_0 experts from flash, cold), {per_suite} prompts each of "
        f"{' + '.join(suites)}, {tokens} new tokens, greedy, every drafter at a fixed K = 4 (no truncation, no "
        f"prefetch), DraftExpert's draft experts: {_draft_experts(res)}, {threads} thread. α = accepted ÷ drafted "
        "draft tokens; draft uniq / verify uniq = layer-experts the drafter ran / the verify block touched per "
        f"round (the paper's Table 3 'Unique'). Tokens equal AR: {res['tokens_equal_ar']}.\n\n"
        + spec_table.table(res)
        + "\n"
    )


def table4_page(res: dict, per_suite: int, tokens: int, threads: int) -> str:
    """Table 4 for one model and engine on mn (a `bench compare --set table4` result)."""
    where = (
        "through llama.cpp (Q4_0 GGUF, whole experts staged on demand from the router tap)"
        if res["engine"] == "llama.cpp"
        else "(Q4_0 experts from flash, cold)"
    )
    return (
        f"{res['model']} on mn {where}, {per_suite} prompts per suite, {tokens} new tokens, "
        f"greedy, {round_settings(res['spec'])}, distilled draft experts, {threads} thread. Verify cost = wall "
        f"seconds per verify forward / per AR forward. hit / waste: of the prefetched experts, the share "
        "verification used / did not; served: the share of requested experts that needed no on-demand load; "
        "MIN served: the same for Belady's optimal cache on the run's own trace of requested experts, with the "
        "most expert memory the run held at once; MIN saves: the share of the loads the run moved (on demand "
        "and prefetched) that it would not need — what a better predictor could still remove. "
        f"Tokens equal AR: {res['tokens_equal_ar']}.\n\n" + spec_table.table4(res) + "\n"
    )


def regime_page(res: dict, per_suite: int, tokens: int, threads: int, machine_id: str) -> str:
    """The regime sweep for one engine (a `bench compare --set regime` result over read caps)."""
    return (
        f"{per_suite} prompt(s) per suite, {tokens} new tokens, greedy, Q4_0, "
        f"{round_settings(res['caps'][0]['spec'])}, {threads} thread, machine {machine_id}; "
        f"`bench compare --set regime --model {res['model']} --engine {res['engine']} --limit {per_suite} "
        f"--max-new-tokens {tokens} --threads {threads}`.\n\n" + regime.table(res)
    )


def engines_page(res: dict, model: str, tokens: int, threads: int) -> str:
    """`bench speed engines`: both engines' AR beside their resident bounds."""
    return (
        f"{model} on mn, Q4_0 experts from one file, {res['prompts']} prompts (one per suite) × {tokens} new "
        f"tokens, greedy, {threads} thread, {res['rounds']} interleaved rounds, each configuration "
        f"loaded afresh per round; machine {res['machine_id']}; `bench speed engines --model {model} "
        f"--max-new-tokens {tokens} --rounds {res['rounds']}`.\n\n" + engines.table(res) + "\n"
    )


def fig2_page(tables: dict[str, str], runs: list[str]) -> str:
    """Fig. 2's tables, one per model, from Table 2/3's torch-engine runs."""
    return (
        "Fig. 2 from Table 2/3's runs on mn (torch engine, Q4_0, cold, K = 4, fixed-K top-r without prefetch; "
        f"DraftExpert with truncation and prefetch), {', '.join(runs)}; the paper's values beside ours.\n\n"
        + "\n".join(f"### {m}\n\n" + t for m, t in tables.items())
    )


def fig3_page(model: str, curves: dict[str, list[float]], per_suite: int, tokens: int, tokens_equal: bool) -> str:
    """Fig. 3's table: the drafters' cumulative unique experts vs draft length (the `fig3` set, K = 8)."""
    return (
        f"{model}: drafter's cumulative unique routed layer-experts vs draft length j (K = 8 fixed, greedy, "
        f"{per_suite} prompts per suite, {tokens} new tokens; tokens equal AR: {tokens_equal}).\n\n"
        + fig3.table(curves)
    )


def fig45_page(model: str, curves: dict, prompts: int, starts: list[int], threads: int, machine_id: str) -> str:
    """Figs. 4–5's table for one model: verify cost and unique experts vs block length, dense beside."""
    return (
        f"{model} on mn (Q4_0 experts from flash, cold store before each forward, torch engine), {prompts} "
        f"prompts, blocks of the target's own greedy continuation at starts {starts}, {threads} thread, "
        f"machine {machine_id}. Dense: {fig45.DENSE_LABEL}, swept over the same blocks, "
        f"its cost normalised to its own one-token step. Paper: {fig45.paper_note(model)}\n\n" + fig45.table(curves)
    )


def table5_page(res: dict, model: str, per_suite: int, tokens: int, report: str) -> str:
    """Table 5 for one model (`bench distill-eval`), `report` its formatted table."""
    t = res.get("teacher") or {"kind": "transformers"}
    where = (
        "the target as one transformers model, decoding on a cold host store"
        if t["kind"] == "transformers"
        else f"the target through the offload runtime on {t['platform']}"
        + (f" ({t['expert_type']} expert file)" if t["platform"] == "mn" else f" ({t['device']})")
        + ", which decodes too"
    )
    return (
        f"{model}: held-out validation windows ({res['held_out_windows']} × {res['seq_len']} tokens) and "
        f"{res['prompts']} prompts ({per_suite} per suite, {tokens} new tokens), DraftExpert at K = 4, greedy, "
        f"no truncation, prefetch on; {where}.\n\n" + report + "\n"
    )


def table1_page(n_runs: int, table: str) -> str:
    """Table 1: one column per platform measured under results/runs."""
    return (
        f"Table 1 from the machine records of {n_runs} runs under results/runs (one column per platform "
        "measured), the paper's two platforms beside them.\n\n" + table
    )
