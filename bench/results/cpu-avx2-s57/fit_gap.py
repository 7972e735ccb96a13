"""Does the draft fit its training sequences better than held-out ones? Chain and tree tau
(simulate_acceptance) of a draft on greedy training-split vs validation-split sequences of one
distilled set it trained on."""
import json, sys, torch
from heterospec.train import trainer as T
from heterospec.train.distill import DistillShard, list_shards

draft_src, data, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2)
target = T.load_target_for_training()
draft = T.load_draft(draft_src, target)
val = T.validation_sequences(data, n, greedy_only=True)
train = []
for path in list_shards(data):
    sh = DistillShard(path)
    for i in range(len(sh)):
        if not T.is_val(sh.prompt_ids[i]) and not bool(sh.sampled[i]):
            train.append((path.name, i))
    if len(train) >= n:
        break
out = {"draft": draft_src, "data": data}
for name, refs in (("train", train[:n]), ("heldout", val)):
    seqs = T.sequences_with_taps(T.load_sequences(data, refs), target)
    tree = T.simulate_acceptance(draft, seqs, top_k=6, depth=6, nodes=24)
    chain = T.simulate_acceptance(draft, seqs, top_k=1, depth=6, nodes=6)
    out[name] = {"seqs": len(seqs), "tau_tree": round(tree["tau"], 3), "tau_chain": round(chain["tau"], 3)}
    print(name, out[name], flush=True)
print(json.dumps(out))
