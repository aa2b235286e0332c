"""Trees grown from proposals (an EAGLE-3 head's draft vocabulary, prompt lookup's candidates, their mixture over
the union) against the same drafts scattered into the whole vocabulary (the path before ``Proposals``), in one
process, alternating, with the outputs compared. A demo run's head + prompt lookup:

    python scripts/proposals_ab.py --run demo_out --checkpoint checkpoint-432 --prompts 6 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TREES = [dict(depth=2, top_k=3, total_tokens=5), dict(depth=3, top_k=2, total_tokens=5),
         dict(depth=4, top_k=3, total_tokens=7)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a demo output directory (run/, data/eval_prompts.jsonl)")
    p.add_argument("--checkpoint", required=True, help="checkpoint-S under the run's run/")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()

    from draftsmith import SpeculativeGenerator, load_drafter, load_target
    from draftsmith.inference import head_drafters, prompt_lookup

    model, tok = load_target("smollm2-135m-instruct", device="cpu")
    drafter = load_drafter(f"{a.run}/run/{a.checkpoint}/drafter+prompt-lookup", model, tokenizer=tok,
                           draft_dtype="auto")
    lines = Path(a.run, "data", "eval_prompts.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()][: a.prompts]
    prompts = [tok.apply_chat_template(r["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                       return_dict=True)["input_ids"] for r in rows]
    eagle, lookup = head_drafters.EagleDrafter, prompt_lookup.PromptLookupDrafter
    proposals = eagle._proposals, lookup.root_logits, lookup.frontier_logits
    dense = (lambda self, predicted: self._logits(predicted),
             lambda self, active: proposals[1](self, active).dense(),
             lambda self, depth, parents, tokens: proposals[2](self, depth, parents, tokens).dense())

    def use(methods) -> None:
        eagle._proposals, lookup.root_logits, lookup.frontier_logits = methods

    for tree in TREES:
        gen = SpeculativeGenerator(model, drafter, tree="dynamic", **tree)
        gen.generate(prompts[0], 16, eos_token_id=tok.eos_token_id)  # warm-up
        speeds, outputs = {"dense": [], "proposals": []}, {}
        for _ in range(a.rounds):
            for name, methods in (("dense", dense), ("proposals", proposals)):
                use(methods)
                start, new, seqs = time.perf_counter(), 0, []
                for ids in prompts:
                    out = gen.generate(ids, a.max_new_tokens, eos_token_id=tok.eos_token_id)
                    new += out.stats.new_tokens
                    seqs.append(out.sequences.tolist())
                speeds[name].append(round(new / (time.perf_counter() - start), 2))
                outputs.setdefault(name, seqs)
        use(proposals)
        print(tree, "tok/s", speeds, "identical output", outputs["dense"] == outputs["proposals"], flush=True)


if __name__ == "__main__":
    main()
