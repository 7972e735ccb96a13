"""Draft half of a round (costmodel.draft_round_ms, interleaved): the shipped draft against the
same draft widened to N MLP units (train-draft --intermediate-size). float32, 2 threads."""
import json, subprocess, sys, tempfile, torch
import heterospec
from heterospec import costmodel
from heterospec.config import SpecConfig
from heterospec.defaults import default_draft_dir
from heterospec.models.draft import Eagle3Draft
from heterospec.train.trainer import warm_start
from heterospec.models.linear import tune_linears

torch.set_num_threads(2)
flags = sorted(set(subprocess.run("grep -o 'avx512_bf16\\|avx512f\\|avx2\\|amx_bf16' /proc/cpuinfo", shell=True,
                                  capture_output=True, text=True).stdout.split()))
out = {"cpu_flags": flags, "torch": torch.__version__}
for tree in ((4, 3, 8), (10, 7, 60)):
    k, d, n = tree
    eng = heterospec.Engine.from_pretrained(config=SpecConfig(top_k=k, depth=d, total_tokens=n), draft_dtype=torch.float32)
    shipped = eng.draft
    drafts, labels = [shipped], ["1536"]
    for inter in (3072, 4608):
        wide = Eagle3Draft.for_target(eng.target, kept_ids=shipped.to_target_ids(torch.arange(shipped.config.draft_vocab_size)),
                                      dtype=torch.float32, intermediate_size=inter)
        warm_start(wide, str(default_draft_dir()), eng.target)
        with tempfile.TemporaryDirectory() as t:       # through the public format, as the engine loads it
            wide.save_pretrained(t)
            drafts.append(Eagle3Draft.from_pretrained(t, target=eng.target, dtype=torch.float32))
        labels.append(str(inter))
    tune_linears(drafts[1:], progress=False)
    ms = costmodel.draft_round_ms(eng, drafts, reps=15, progress=False)
    out[str(tree)] = dict(zip(labels, [round(m, 3) for m in ms]))
    print(tree, out[str(tree)], flush=True)
print(json.dumps(out))
