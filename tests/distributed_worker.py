"""Run under `mlx.launch --backend ring -n 2` by tests/test_distributed.py: every rank loads
its share of MODEL and runs the distributed engine; rank 0 prints one JSON object.

  greedy: for each of DEPTHS (k = 0..4 and adaptive), batch 1 and 4: the tokens of PROMPTS;
          with JOBS (a JSON list of {model, prompts, max_tokens, depths[, batches, suffix]}), each
          job in turn on the ranks of one launch; `suffix`: suffix drafts beside the head, and
          the tokens they drafted that were kept
  sample:  N sampled requests of 3 tokens (k=2), seeds from SEED0: each request's tokens; with
           AGAIN (a prompt), 4 more of it sampled with suffix drafts beside the head (adaptive)
           and the drafts each drafter had kept
  disagree: as greedy, but rank 1 pretends to have decoded something else (a machine whose
            logits differ): the run must stop, not go on
"""

import argparse
import json

from mlxmtp.distributed.coordinator import RankCoordinator
from mlxmtp.distributed.engine import DistributedEngine
from mlxmtp.distributed.group import launched_group
from mlxmtp.distributed.load import load_on_rank
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams

# The 2-rank sampling test's engine (test_distributed.py builds the one-process one alike):
# its prefix cache gives every request after the first the shared prompt's state.
SAMPLED = EngineConfig(num_draft=2, max_batch=64, prefix_cache_bytes=64 << 20)


def run(engine, batches, kept_by=None):
    """Rank 0: the tokens of every request, batch after batch (each submitted at once when
    the one before has finished), adding to `kept_by` each drafter's kept drafts; other
    ranks: None. The engine is closed at the end."""
    if not engine.leader:
        engine.follow()
        return None
    out = []
    for requests in batches:
        for r in requests:
            engine.submit(r)
        tokens = {r.id: [] for r in requests}
        done = set()
        while len(done) < len(requests):
            for ev in engine.step():
                tokens[ev.request_id].extend(ev.token_ids)
                if ev.finish_reason is not None:
                    assert ev.finish_reason != "error", ev.error
                    done.add(ev.request_id)
                    if kept_by is not None:
                        for source, n in ev.stats.as_dict().get("by_source", {}).items():
                            kept_by[source] = kept_by.get(source, 0) + n["accepted"]
        out += [tokens[r.id] for r in requests]
    engine.close()
    return out


def greedy(group, model, tok, prompts, max_tokens, depths, batches=(1, 4), suffix=False):
    out, kept_by = {}, {}
    for k in depths:
        for batch in batches:
            config = EngineConfig(num_draft=k, suffix_drafts=suffix)
            engine = DistributedEngine(model, tok, config, group=group, dist_timeout=120)
            requests = [Request(prompt=p, max_tokens=max_tokens) for p in prompts]
            groups = [requests[i : i + batch] for i in range(0, len(requests), batch)]
            out[f"k={'adaptive' if k is None else k}/B={batch}"] = run(engine, groups, kept_by)
    return {"tokens": out, "kept_by": kept_by}


def sample(group, model, tok, n, seed0, temperature, again=None):
    engine = DistributedEngine(model, tok, SAMPLED, group=group, dist_timeout=120)
    prompt = [5, 17, 42, 9, 33, 2]
    out = {"tokens": run(engine, [[Request(prompt=prompt, max_tokens=3,
                                           params=SamplingParams(temperature=temperature, seed=s))
                                   for s in range(seed0, seed0 + n)]])}
    if again:
        kept_by = {}
        engine = DistributedEngine(model, tok, EngineConfig(max_batch=4, suffix_drafts=True), group=group,
                                   dist_timeout=120)
        run(engine, [[Request(prompt=again, max_tokens=32, params=SamplingParams(temperature=temperature, seed=s))
                      for s in range(4)]], kept_by)
        out["kept_by"] = kept_by
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("job", choices=["greedy", "sample", "disagree"])
    ap.add_argument("--model")
    ap.add_argument("--jobs", default="[]")
    ap.add_argument("--prompts", default="[]")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--depths", default="0,1,2,3,4,adaptive")
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--again", default="[]")
    a = ap.parse_args()
    group = launched_group()
    if a.job == "disagree" and group.rank() == 1:
        after_cycle = RankCoordinator.after_cycle

        def skewed(self, kept, tokens):
            after_cycle(self, kept, tokens)
            self.digest ^= 1

        RankCoordinator.after_cycle = skewed
    jobs = json.loads(a.jobs) or [dict(model=a.model, prompts=json.loads(a.prompts), max_tokens=a.max_tokens,
                                       depths=a.depths)]
    results, layers = [], []
    for job in jobs:
        model, tok, plan = load_on_rank(group, job["model"], EngineConfig())
        layers.append([r.layers for r in plan.ranks])
        if a.job in ("greedy", "disagree"):
            depths = [None if d == "adaptive" else int(d) for d in job["depths"].split(",")]
            results.append(greedy(group, model, tok, job["prompts"], job["max_tokens"], depths,
                                  job.get("batches", (1, 4)), job.get("suffix", False)))
        else:
            results.append(sample(group, model, tok, a.n, a.seed0, a.temperature, json.loads(a.again)))
    if group.rank() == 0:
        result = results if a.jobs != "[]" else results[0]
        print(json.dumps({"result": result, "layers": layers if a.jobs != "[]" else layers[0]}), flush=True)

if __name__ == "__main__":
    main()
