"""An engine switch on and off, interleaved in one process: what one speed-only change is worth.

Switches (the outputs never change; the first two leave the verified trees unchanged too, so
only time moves):

- ``dead-layers``: ``Engine.stop_dead_layers``. A request stops drafting once every candidate of
  its last drafted layer scores below its ``budget``-th best candidate (no deeper node could enter
  its Top-N): draft forwards are saved.
- ``streamed-draft``: ``heterospec.models.draft.STREAMED_DRAFT``. The draft's CPU steps run
  without their modules' dispatch and attend with the tree_attention op over the draft cache.
- ``draft-q8_0``: the draft with its weights rounded to 8-bit codes (``--draft-dtype q8_0``)
  against the same draft in float32. This one may move the draft's proposals (so tau), never
  the output.

Per method (eagle3, heterospec) and set: tokens/s with the switch on over off (each prompt run
both ways back to back, the order alternating), draft forwards per round, draft ms per round,
and a check that both ways gave the same tokens.

    python bench/switch_ab.py --switch streamed-draft [--sets mtbench humaneval gsm alpaca cnndm]
        [--n 4] [--max-new-tokens 128] [--dtype float32] [--out bench/out/<switch>]

Writes ``OUT/<switch>_ab.json`` and ``.md``. Run with nothing else on the machine.
``bench/dead_layers_ab.py`` is this script with ``--switch dead-layers``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm

import heterospec
from heterospec.bench import load_prompt_sets, speed_flags, write_report


def _counting(draft, calls):
    """Wrap ``draft.tree_step`` to count draft forwards in ``calls[0]`` (one per call, whole batch)."""
    inner = draft.tree_step

    def tree_step(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)
    draft.tree_step = tree_step
    return calls


def _set_dead_layers(eng, on: bool) -> None:
    eng.stop_dead_layers = on


def _set_streamed_draft(eng, on: bool) -> None:
    from heterospec.models import draft
    draft.STREAMED_DRAFT = on


def _set_draft_q8_0(eng, on: bool) -> None:
    """The draft with q8_0 weights (on) or float32 ones (off): both built once from the draft's
    file (the engine's own may already be rounded), tuned, swapped."""
    from heterospec import Eagle3Draft
    from heterospec.costmodel import _draft_copy
    from heterospec.models.linear import tune_linears
    forms = getattr(eng, "_ab_drafts", None)
    if forms is None:
        f32 = Eagle3Draft.from_pretrained(eng.draft_dir, target=eng.target, dtype=torch.float32)
        forms = eng._ab_drafts = {"float32": f32, "q8_0": _draft_copy(f32, "q8_0")}
        tune_linears(list(forms.values()))
    eng.draft = forms["q8_0" if on else "float32"]


SWITCHES = {"dead-layers": _set_dead_layers, "streamed-draft": _set_streamed_draft, "draft-q8_0": _set_draft_q8_0}


def main(argv=None, switch: str | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), default=switch, required=switch is None)
    ap.add_argument("--sets", nargs="+", default=["mtbench", "humaneval", "gsm", "alpaca", "cnndm"])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="+", default=["eagle3", "heterospec"])
    ap.add_argument("--out", default=None, help="default: bench/out/<switch>")
    args = ap.parse_args(argv)
    flip = SWITCHES[args.switch]
    flags = speed_flags(announce=True)
    eng = heterospec.Engine.from_pretrained(device="cpu", dtype=getattr(torch, args.dtype))
    flip(eng, False)                                            # (a switch may build what it swaps)
    calls = [0]
    for d in {id(d): d for d in [eng.draft, *getattr(eng, "_ab_drafts", {}).values()]}.values():   # (each once)
        _counting(d, calls)
    sets = load_prompt_sets(args.sets, args.n, 0)
    for m in args.methods:                                      # warm-up, untimed
        eng.generate(sets[args.sets[0]][0].text, max_new_tokens=16, method=m)
    rows = {}
    jobs = [(s, p, m) for s in args.sets for p in sets[s] for m in args.methods]
    for i, (s, prompt, m) in enumerate(tqdm(jobs, desc=f"{args.switch} A/B", unit="prompt")):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {}
        for on in order:
            flip(eng, on)
            calls[0] = 0
            t0 = time.perf_counter()
            out = eng.generate(prompt.text, max_new_tokens=args.max_new_tokens, method=m)
            got[on] = (out, time.perf_counter() - t0, calls[0])
        r = rows.setdefault((m, s), {"tokens": 0, "s_on": 0.0, "s_off": 0.0, "fw_on": 0, "fw_off": 0, "rounds": 0,
                                     "rounds_off": 0, "draft_s_on": 0.0, "draft_s_off": 0.0, "same": True})
        (on, s_on, f_on), (off, s_off, f_off) = got[True], got[False]
        r["tokens"] += len(on.token_ids)
        r["s_on"] += s_on
        r["s_off"] += s_off
        r["fw_on"] += f_on
        r["fw_off"] += f_off
        r["rounds"] += on.stats.rounds
        r["rounds_off"] += off.stats.rounds
        r["draft_s_on"] += on.stats.draft_s
        r["draft_s_off"] += off.stats.draft_s
        r["same"] &= on.token_ids == off.token_ids
    flip(eng, True)
    lines = [f"{args.switch} on / off. CPU flags: {' '.join(flags)}; {args.dtype}; {args.n} prompts x "
             f"{args.max_new_tokens} tokens per set",
             "", "| method | set | tok/s on / off | ratio | tokens per round on / off | draft forwards per round on / off "
             "| draft ms per round on / off | same tokens |", "|---|---|---|---|---|---|---|---|"]
    for m in args.methods:
        ratios = []
        for s in args.sets:
            r = rows[(m, s)]
            ratio = r["s_off"] / r["s_on"]
            ratios.append(ratio)
            n, n_off = max(r["rounds"], 1), max(r["rounds_off"], 1)
            # tokens per speculative round (eagle3: tau; heterospec also counts its plain steps' tokens)
            lines.append(f"| {m} | {s} | {r['tokens'] / r['s_on']:.1f} / {r['tokens'] / r['s_off']:.1f} | {ratio:.3f} "
                         f"| {r['tokens'] / n:.2f} / {r['tokens'] / n_off:.2f} "
                         f"| {r['fw_on'] / n:.2f} / {r['fw_off'] / n_off:.2f} | {1e3 * r['draft_s_on'] / n:.2f} / "
                         f"{1e3 * r['draft_s_off'] / n_off:.2f} | {r['same']} |")
        lines.append(f"| {m} | **mean** | | **{statistics.mean(ratios):.3f}** | | | | |")
    stem = args.switch.replace("-", "_") + "_ab"
    write_report(args.out or f"bench/out/{args.switch}", stem, "\n".join(lines),
                 {"flags": flags, "args": vars(args), "rows": {f"{m}/{s}": r for (m, s), r in rows.items()}})


if __name__ == "__main__":
    main()
