"""Speculative decoding end to end (config `speculative`): with each proposer (n-gram lookup, a draft model,
an EAGLE-3 head in the published layout) greedy output equals transformers' own, at TP 1, 2 and 4; a draft
that is the model itself has every token accepted; sampled output is reproducible and the same at every TP;
logprobs, stop ids, lengths, n, preemption and the prefix cache behave as without speculation; a draft of
another tokenizer or hidden size is refused by name at start-up. The adaptive policy is checked in a model of
step costs (`drive`) and, for what the engine reports to it (switches, probes), in the engine."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, hf_generate, make_checkpoint, run_cli
from test_eagle3 import make_head
from tp_engine import LLM, SamplingParams
from tp_engine.comm import StartupError

NEW = 24
# repetition in the prompts, so that n-gram lookup drafts; other tokens where it does not
PROMPTS = [[5, 9, 13, 7, 5, 9, 13, 7, 5, 9], [100, 200, 300, 100, 200], [42] * 6, [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The target (8 layers, as the EAGLE head's aux layers need), a smaller draft of its vocabulary and a
    head; a target with its own kind of peaked weights gives repeated tokens the n-gram lookup can find."""
    root = tmp_path_factory.mktemp("spec")
    target = make_checkpoint(root / "target", vocab=512, hidden=64, layers=8)
    draft = make_checkpoint(root / "draft", vocab=512, hidden=32, inter=64, layers=1, heads=4, kv_heads=2,
                            head_dim=8, seed=3)
    return {"target": target, "draft": draft, "head": make_head(root / "head", "shared")}


def spec_of(models: dict, method: str | None, k: int = 4, adaptive: bool = False) -> dict:
    """The `speculative` section of a run with `method` (draft_self: the target drafts for itself)."""
    if method is None:
        return {"method": None}
    model = {"draft": models["draft"], "draft_self": models["target"], "eagle3": models["head"]}.get(method)
    return {"method": "draft" if method == "draft_self" else method, "model": str(model) if model else None,
            "num_tokens": k, "adaptive": adaptive}


def generate(models: dict, method: str | None, sampling: dict, prompts=PROMPTS, **cfg) -> tuple[list, dict]:
    llm = LLM(model=str(models["target"]), device="cpu", speculative=spec_of(models, method), **cfg)
    try:
        outs = llm.generate([{"input_ids": p} for p in prompts], SamplingParams(**sampling))
        return outs, llm.engine.spec_summary()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def hf(models) -> list[list[int]]:
    return hf_generate(models["target"], PROMPTS, NEW)


@pytest.mark.parametrize("method", ["ngram", "draft", "draft_self", "eagle3"])
def test_greedy_equals_transformers(models, hf, method):
    """Greedy output with each proposer is transformers' greedy output, token for token."""
    outs, counts = generate(models, method, {"max_new_tokens": NEW})
    assert [o["output_token_ids"] for o in outs] == hf
    assert counts["spec_share"] > 0.5  # the steps did speculate (adaptive off)


def test_the_model_as_its_own_draft_has_every_token_accepted(models):
    """A draft that is the target proposes what the target picks: greedy accepts every draft, and sampling
    (p = q up to rounding) all but a rare one."""
    _, greedy = generate(models, "draft_self", {"max_new_tokens": NEW, "ignore_eos": True})
    assert greedy["acceptance_rate"] == 1.0 and greedy["accept_length"] > 4
    _, sampled = generate(models, "draft_self", {"max_new_tokens": NEW, "ignore_eos": True,
                                                 "temperature": 0.8, "top_k": 50})
    assert sampled["acceptance_rate"] >= 0.98


def test_sampled_runs_are_reproducible_and_keep_every_setting(models):
    """Sampling with a draft is the same twice; n, logprobs, stop ids and lengths hold as without it."""
    sampling = {"max_new_tokens": 13, "temperature": 0.9, "top_p": 0.9, "n": 2, "logprobs": 3, "seed": 7}
    a, _ = generate(models, "draft", sampling)
    b, _ = generate(models, "draft", sampling)
    assert [o["output_token_ids"] for o in a] == [o["output_token_ids"] for o in b]
    assert len(a) == 2 * len(PROMPTS)
    for o in a:
        assert len(o["logprobs"]) == len(o["output_token_ids"]) <= 13
        assert [e["token"] for e in o["logprobs"]] == o["output_token_ids"]
    stop = hf_stop = None
    for out in hf_generate(models["target"], PROMPTS, NEW):
        if len(out) > 5:
            stop, hf_stop = out[4], out
            break
    greedy, _ = generate(models, "ngram", {"max_new_tokens": NEW, "stop_token_ids": [stop], "logprobs": 2})
    plain, _ = generate(models, None, {"max_new_tokens": NEW, "stop_token_ids": [stop], "logprobs": 2})
    assert hf_stop is not None
    for g, p in zip(greedy, plain):
        assert g["output_token_ids"] == p["output_token_ids"] and g["finish_reason"] == p["finish_reason"]
        for eg, ep in zip(g["logprobs"], p["logprobs"]):
            assert eg["token"] == ep["token"] and abs(eg["logprob"] - ep["logprob"]) < 1e-4
            assert [t for t, _ in eg["top"]] == [t for t, _ in ep["top"]]


def test_preemption_and_the_prefix_cache_under_speculation(models, hf):
    """A pool too small for every request at once preempts and recomputes; prompts sharing pages read them
    from the prefix cache; greedy output is still transformers'."""
    prompts = PROMPTS + [PROMPTS[0] + [1, 2, 3, 4, 5, 6, 7, 8]]
    want = hf + hf_generate(models["target"], prompts[-1:], NEW)
    for method in ("draft", "eagle3"):
        llm = LLM(model=str(models["target"]), device="cpu", speculative=spec_of(models, method),
                  kv_cache={"num_pages": 12, "page_size": 4})
        try:
            outs = llm.generate([{"input_ids": p} for p in prompts], SamplingParams(max_new_tokens=NEW))
            assert llm.engine.num_preempted > 0
        finally:
            llm.shutdown()
        assert [o["output_token_ids"] for o in outs] == want, method
        assert outs[-1]["cached_prompt_tokens"] > 0


JOB = """
import json, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
from tp_engine.comm import StartupError
results = {{}}
for name, (spec, sampling) in {runs!r}.items():
    llm = LLM(model={target!r}, device="cpu", speculative=spec)
    outs = llm.generate([{{"input_ids": p}} for p in {prompts!r}], SamplingParams(**sampling))
    llm.shutdown()
    results[name] = outs and [o["output_token_ids"] for o in outs]
if results[next(iter(results))] is not None:
    with open({out!r}, "w") as f:
        json.dump(results, f)
"""


def job(models: dict, runs: dict, tp: int, tmp_path: Path) -> dict:
    """{name: rank 0's output ids} for each run (a `speculative` section and the sampling keys), in one
    torchrun job of `tp` ranks."""
    out = tmp_path / f"results{tp}.json"
    script = tmp_path / f"job{tp}.py"
    script.write_text(JOB.format(root=str(ROOT), runs=runs, target=str(models["target"]), prompts=PROMPTS,
                                 out=str(out)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}",
                           "--standalone", str(script)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_every_proposer_at_tp(models, hf, tp, tmp_path):
    """At TP 2 and 4 (the draft and the head sharded like the target) greedy output is transformers', and a
    sampled run gives the tokens it gives at TP 1."""
    greedy = {"max_new_tokens": NEW}
    sampled = {"max_new_tokens": 12, "temperature": 0.8, "top_k": 40, "seed": 3}
    runs = {m: (spec_of(models, m), greedy) for m in ("ngram", "draft", "eagle3")}
    runs["sampled"] = (spec_of(models, "draft"), sampled)
    got = job(models, runs, tp, tmp_path)
    for m in ("ngram", "draft", "eagle3"):
        assert got[m] == hf, m
    one, _ = generate(models, "draft", sampled)
    assert got["sampled"] == [o["output_token_ids"] for o in one]


def test_bad_drafts_are_refused_by_name(models, tmp_path):
    """A draft of another vocabulary or tokenizer, or a head whose fc does not take the target's hidden
    size, stops the start-up with a message naming the file."""
    other = make_checkpoint(tmp_path / "other", vocab=256, hidden=32, layers=1)
    with pytest.raises(StartupError, match=r"other/config.json: vocab_size 256 differs from the target's"):
        LLM(model=str(models["target"]), device="cpu", speculative={"method": "draft", "model": str(other)})
    demo = ROOT / "configs" / "models" / "demo"
    target, draft = tmp_path / "t", tmp_path / "d"
    shutil.copytree(demo, target)
    shutil.copytree(demo, draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(StartupError, match=r"d/tokenizer.json differs from the target's"):
        LLM(model=str(target), device="cpu", speculative={"method": "draft", "model": str(draft)})
    head = json.loads((models["head"] / "config.json").read_text())
    bad = shutil.copytree(models["head"], tmp_path / "head")
    (bad / "config.json").write_text(json.dumps({**head, "target_hidden_size": 32}))
    with pytest.raises(StartupError, match=r"head/config.json"):
        LLM(model=str(models["target"]), device="cpu", speculative={"method": "eagle3", "model": str(bad)})


def test_the_summary_line_reports_acceptance(models, tmp_path):
    """The command line's summary names the acceptance rate, the accepted length and the share of steps
    that speculated."""
    cfg = {"model": str(models["target"]), "prompts": [{"input_ids": p} for p in PROMPTS],
           "sampling": {"max_new_tokens": 8}, "speculative": spec_of(models, "draft_self")}
    proc, lines = run_cli(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stderr.split("summary: ")[1].splitlines()[0])
    assert summary["acceptance_rate"] == 1.0 and summary["spec_share"] > 0.5
    assert summary["accept_length"] > 1 and len(lines) == len(PROMPTS)


def drive(policy, batch: int, steps: int, cost: float, gain: float, switch: float = 0.0, catch: float = 0.0,
          behind: int = 0) -> tuple[list[int], float]:
    """The policy's choices over `steps` steps of `batch` decoding requests (-k: a probe, where probe_rows
    requests draft k), and the tokens a request gained per ms. A plain step takes 1 ms; a step of k drafts
    takes 1 + cost * k ms and gains 1 + gain * k tokens a request. A proposer `behind` by more than k_max + 2
    tokens (it sat out plain steps, or has not seen the prompt) first catches up, as speculation.py reports
    it: `switch` ms and `catch` ms a token more. A probe costs its rows' share of a step's drafting and
    catch-up."""
    seen, spent, gained = [], 0.0, 0.0
    for _ in range(steps):
        k = policy.choose(batch)
        switching = k and behind > policy.k_max + 2
        extra = cost * k + (switch + catch * behind if switching else 0)
        if policy.probe is not None:
            seen.append(-k)
            rows = min(policy.probe_rows, batch)
            ms, g = 1 + extra * rows / batch, 1 + gain * k * rows / batch
            policy.count(k * rows, gain * k * rows, rows)
            policy.record_probe(batch, ms / 1000)
        else:
            seen.append(k)
            ms, g = 1 + extra, 1 + gain * k
            if not k:
                behind += 1
                policy.record(batch, 0, g, ms / 1000)
            else:
                (policy.record_switch if switching else policy.record)(batch, k, g, ms / 1000)
                behind = 1
            policy.count(k * batch, gain * k * batch, batch if k else 0)
        spent, gained = spent + ms, gained + g
    return seen, gained / spent


def test_the_policy_speculates_only_where_it_pays():
    """Per batch-size class the policy measures k = 0, then 1, 2, ... while each beats the one before, keeps
    the one that gained the most tokens per second, and now and then looks at a neighbour (and at plain
    steps); off (adaptive false) it always drafts k."""
    from tp_engine.speculative.policy import PLAIN_EVERY, PROBE_EVERY, SpecPolicy

    policy = SpecPolicy(3, adaptive=True)
    # batch 1: speculating pays, the more drafts the better
    seen, _ = drive(policy, 1, 4 * PROBE_EVERY, cost=0.1, gain=0.8)
    assert seen[:4] == [0, 1, 2, 3]
    steady = seen[4:]
    assert steady.count(3) >= len(steady) * (1 - 1 / PLAIN_EVERY) - 8, steady
    assert set(steady) == {0, 2, 3}  # plain steps and the neighbour looked at again
    # batch 64: it does not; k = 1 loses to plain steps, so 2 and 3 are never tried
    seen, _ = drive(policy, 64, 4 * PROBE_EVERY, cost=1.0, gain=0.1)
    assert seen[:2] == [0, 1] and set(seen[2:]) <= {0, 1} and seen[2:].count(1) <= 6, seen
    assert all(SpecPolicy(3, adaptive=False).choose(b) == 3 for b in (1, 64))


@pytest.mark.parametrize("cost,gain", [(0.1, 0.9), (0.13, 0.55), (0.3, 0.8)])
def test_where_speculating_wins_the_policy_gains_nearly_what_the_best_k_does(cost, gain):
    """Where drafts pay (gains of 1.9x to 3.3x a plain step), 4,096 steps of the adaptive policy, its start,
    plain steps and neighbours included, gain at least 98% of the tokens per ms of the best fixed k."""
    from tp_engine.speculative.policy import SpecPolicy

    _, rate = drive(SpecPolicy(4, adaptive=True), 1, 4096, cost=cost, gain=gain, switch=10.0, catch=0.01,
                    behind=128)
    best = max((1 + gain * k) / (1 + cost * k) for k in range(5))
    assert rate >= 0.98 * best, (rate, best)


def test_the_policy_looks_at_a_losing_k_less_and_less_often():
    """While plain steps win, the looks at k > 0 come after 64, 128, 256, ... steps (a look costs a whole
    speculating step); each look is a step that catches the proposer up and one that measures k. When the
    text turns to one where drafts are accepted, speculation resumes at the next look, and when it turns
    back, plain steps win again within a few of their looks."""
    from tp_engine.speculative.policy import LOOK_MOST, PROBE_EVERY, SpecPolicy

    policy = SpecPolicy(4, adaptive=True)
    seen, _ = drive(policy, 1, 8192, cost=1.0, gain=0.0)  # acceptance 0
    looks = [i for i, k in enumerate(seen) if k][1:]  # after the first measure of k = 1
    starts = looks[::2]
    assert looks[1::2] == [i + 1 for i in starts]  # a catch-up, then the measure
    gaps = [b - a - 2 for a, b in zip(starts, starts[1:])]  # plain steps between two looks
    assert gaps[:4] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, 16 * PROBE_EVERY], looks
    assert len(starts) <= 8 and max(gaps) <= LOOK_MOST
    seen, _ = drive(policy, 1, 2 * LOOK_MOST, cost=0.1, gain=0.9, behind=LOOK_MOST)  # acceptance high
    assert seen[-PROBE_EVERY:].count(0) < PROBE_EVERY // 4
    seen, _ = drive(policy, 1, 64, cost=1.0, gain=0.0)  # and low again
    assert seen[-16:].count(0) >= 15, seen


def test_a_costly_switch_makes_the_looks_rarer():
    """A proposer that catches up before it drafts (a draft model after plain steps: ~10 plain steps' time,
    more the longer it sat out) makes each look cost that much: at acceptance 0 the policy spaces its looks
    so that a 256-token run after a 32-token one loses nothing and a long one under 3%, while at high
    acceptance it still settles on the most drafts after one catch-up."""
    from tp_engine.speculative.policy import SpecPolicy

    cost = {"cost": 1.0, "switch": 10.0, "catch": 0.01}
    policy = SpecPolicy(4, adaptive=True)
    drive(policy, 1, 32, gain=0.0, behind=128, **cost)  # a warm-up request: its prompt is 128 tokens
    seen, rate = drive(policy, 1, 256, gain=0.0, behind=128 + 32, **cost)
    assert rate == 1.0, seen
    seen, rate = drive(policy, 1, 8192, gain=0.0, behind=128 + 288, **cost)
    assert rate >= 0.97 and 0 < sum(map(bool, seen)) <= 16, rate
    cheap = {**cost, "cost": 0.1}  # a small draft, or a head
    seen, rate = drive(SpecPolicy(4, adaptive=True), 1, 512, gain=0.9, behind=128, **cheap)
    assert seen[:7] == [0, 1, 1, 2, 3, 4, 4] and rate > 2.9, (seen[:16], rate)


def test_n_gram_lookup_without_matches_decodes_plainly():
    """n-gram lookup that never finds a match: every k counts as a little worse than a plain step."""
    from tp_engine.speculative.policy import PROBE_EVERY, SpecPolicy

    policy = SpecPolicy(3, adaptive=True)
    seen = []
    for _ in range(2 * PROBE_EVERY):
        k = policy.choose(8)
        seen.append(k)
        if k:
            policy.record_empty(8, k)
        else:
            policy.record(8, 0, 1.0, 1e-3)
    assert seen[:2] == [0, 1] and seen[2:].count(0) >= len(seen[2:]) * 0.95


def test_constrained_requests_decode_beside_speculating_ones():
    """A request with an output constraint shares the speculating steps without drafting: its output is the
    one it has without speculation, and the others' too."""
    demo = ROOT / "configs" / "models"
    prompts = ["Alice was beginning to get very tired",
               {"prompt": "Down, down, down. Would the fall", "sampling": {"regex": "[a-z ]{3,12}[.]"}},
               {"prompt": "'Curiouser and curiouser!' cried Alice",
                "sampling": {"choice": ["yes", "no way"]}}]
    outs = {}
    for method in (None, "draft"):
        spec = {"method": method, "model": str(demo / "demo-draft") if method else None, "adaptive": False}
        llm = LLM(model=str(demo / "demo"), device="cpu", speculative=spec)
        try:
            outs[method] = llm.generate(prompts, SamplingParams(max_new_tokens=30))
            counts = llm.engine.spec_summary()
        finally:
            llm.shutdown()
    assert [o["output_token_ids"] for o in outs["draft"]] == [o["output_token_ids"] for o in outs[None]]
    assert [o["constraint"] for o in outs["draft"][1:]] == ["complete", "complete"]
    assert counts["spec_share"] > 0.5 and counts["acceptance_rate"] > 0.9


def test_stop_strings_end_where_they_end_without_speculation():
    """Tokens a verifying step accepts go in one at a time, so a stop string inside them ends the request at
    the same token, with the same text, as plain decoding."""
    demo = ROOT / "configs" / "models"
    prompts = ["Alice was beginning to get very tired", "Down, down, down. Would the fall"]
    outs = {}
    for method in (None, "draft"):
        spec = {"method": method, "model": str(demo / "demo-draft") if method else None, "adaptive": False}
        llm = LLM(model=str(demo / "demo"), device="cpu", speculative=spec)
        try:
            outs[method] = llm.generate(prompts, SamplingParams(max_new_tokens=40, stop=["her", "thing"]))
        finally:
            llm.shutdown()
    for a, b in zip(outs["draft"], outs[None]):
        assert (a["output_token_ids"], a["text"], a["finish_reason"]) == \
            (b["output_token_ids"], b["text"], b["finish_reason"])
    assert all(o["finish_reason"] == "stop" for o in outs[None])


DP_JOB = """
import json, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
llm = LLM(model={target!r}, device="cpu", tensor_parallel_size=1, speculative={spec!r})
outs = llm.generate([{{"input_ids": p}} for p in {prompts!r}], SamplingParams(max_new_tokens={new}))
if outs is not None:
    with open({out!r}, "w") as f:
        json.dump({{"ids": [o["output_token_ids"] for o in outs],
                   "counts": llm.engine.spec.policy.counts.fields()}}, f)
llm.shutdown()
"""


@pytest.mark.slow
def test_data_parallel_replicas_count_every_replicas_drafts(models, hf, tmp_path):
    """Two data-parallel replicas speculate each on its share; the counts the summary reports are the sum of
    both, the same as one engine's over the whole job (the model drafting for itself, greedy, k fixed)."""
    spec = spec_of(models, "draft_self")
    script, out = tmp_path / "dp.py", tmp_path / "dp.json"
    script.write_text(DP_JOB.format(root=str(ROOT), target=str(models["target"]), spec=spec, prompts=PROMPTS,
                                    new=NEW, out=str(out)))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    proc = subprocess.run([*launch, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["ids"] == hf
    llm = LLM(model=str(models["target"]), device="cpu", speculative=spec)
    try:
        llm.generate([{"input_ids": p} for p in PROMPTS], SamplingParams(max_new_tokens=NEW))
        alone = llm.engine.spec.policy.counts.fields()
    finally:
        llm.shutdown()
    for name in ("drafted", "accepted", "verified_rows"):
        assert got["counts"][name] == alone[name], (name, got["counts"], alone)


def test_the_policy_times_plain_steps_that_only_decode():
    """A plain step's time (from its issue to the next step's) reaches the policy only when the step carried
    no prompt tokens, which would measure the prefill, not the decoding; a plain step followed by a
    speculating one is timed to that one's start."""
    from types import SimpleNamespace

    from tp_engine.runtime.speculation import Speculation

    spec = Speculation(SimpleNamespace(cfg={"speculative": {"method": "ngram", "num_tokens": 4,
                                                            "adaptive": True}}))
    timed = []
    spec.policy.record = lambda batch, k, gained, seconds: timed.append((batch, k))
    decode, prompt = SimpleNamespace(reqs=[1, 2], lens=[1, 1]), SimpleNamespace(reqs=[1, 2], lens=[1, 40])
    for batch, plan in ((2, decode), (2, prompt), (1, decode), (3, decode)):
        spec._decoding = batch
        spec.plain_step(plan)
    assert timed == [(2, 0), (1, 0)]  # the prompt step is not timed; the last is still running
    spec._end_plain(0.0)  # as a speculating step's start does
    assert timed == [(2, 0), (1, 0), (3, 0)]


def test_no_acceptance_anywhere_keeps_new_batch_sizes_plain():
    """Drafts accepted at no batch size: once one class has measured that, the classes a shrinking batch
    goes through wait for a look rather than each paying a catch-up to measure k = 1 at once; with drafts
    accepted they measure it at once."""
    from tp_engine.speculative.policy import PROBE_EVERY, SpecPolicy

    policy = SpecPolicy(4, adaptive=True)
    seen, _ = drive(policy, 64, 32, cost=1.0, gain=0.0, switch=10.0, behind=128)
    assert seen[:2] == [0, -1] and not any(seen[2:]), seen  # no draft verified yet: a probe first
    for batch in (32, 16, 8, 4, 2, 1):  # requests finish: a class each 32 steps
        seen, rate = drive(policy, batch, PROBE_EVERY // 2, cost=1.0, gain=0.0, switch=10.0, behind=160)
        assert not any(seen) and rate == 1.0, (batch, seen)
    seen, _ = drive(policy, 1, 4 * PROBE_EVERY, cost=0.1, gain=0.9, behind=160)  # the text turns
    assert 0 < seen.index(1) <= PROBE_EVERY and seen[-PROBE_EVERY:].count(0) < PROBE_EVERY // 4, seen
    policy = SpecPolicy(4, adaptive=True)
    seen, _ = drive(policy, 64, 32, cost=0.1, gain=0.9, switch=10.0, behind=128)
    assert seen[:4] == [0, -1, 1, 1], seen  # the probe's drafts are accepted: a whole look at once
    seen, _ = drive(policy, 32, 8, cost=0.1, gain=0.9, switch=10.0, behind=160)
    assert seen[:3] == [0, 1, 1], seen


def test_new_classes_of_a_shrinking_batch_space_their_probes_by_the_latest_cost():
    """At acceptance 0, probes costing about 25 plain steps each (8 requests' catch-up): as the batch of a
    64-request run shrinks through new classes, each lasting longer than PROBE_EVERY steps, a class that
    has not probed spaces its first probe by the latest probe's cost, so the run keeps 97% of plain
    steps' rate and probes at most twice."""
    from tp_engine.speculative.policy import SpecPolicy

    policy, seen, spent, gained = SpecPolicy(4, adaptive=True), [], 0.0, 0.0
    for batch, steps in ((64, 300), (48, 150), (24, 150), (13, 150), (5, 150)):
        got, rate = drive(policy, batch, steps, cost=1.0, gain=0.0, catch=1.25, behind=160)
        seen += got
        spent, gained = spent + steps / rate, gained + steps  # a plain step gains 1 token in 1 ms
    probes = [i for i, k in enumerate(seen) if k < 0]
    assert len(probes) <= 2 and gained / spent >= 0.97, (probes, gained / spent)


def test_while_drafts_are_not_accepted_a_look_at_a_batch_is_a_probe():
    """At acceptance 0, a look at a batch of 64 drafts for one request only (a probe: its catch-up, not
    every request's); when the text turns and the probe's drafts are accepted, the next step looks with
    every request and speculation resumes."""
    from tp_engine.speculative.policy import PROBE_EVERY, SpecPolicy

    policy = SpecPolicy(4, adaptive=True)
    cost = {"switch": 40.0, "catch": 0.0}  # a catch-up over 64 requests' contexts
    seen, _ = drive(policy, 64, 32, cost=1.0, gain=0.0, behind=128, **cost)
    assert seen[:2] == [0, -1] and not any(seen[2:]), seen
    seen, rate = drive(policy, 64, 4096, cost=1.0, gain=0.0, behind=160, **cost)
    probes = [i for i, k in enumerate(seen) if k < 0]
    assert min(seen) == -1 and max(seen) == 0 and 3 <= len(probes) <= 7 and rate > 0.99, (probes, rate)
    seen, _ = drive(policy, 64, 8192, cost=0.1, gain=0.9, behind=160, **cost)  # the text turns
    first = next(i for i, k in enumerate(seen) if k < 0)
    assert seen[first + 1:first + 3] == [1, 1], seen[first:first + 8]  # a whole look: catch-up, measure
    assert seen[-PROBE_EVERY:].count(0) < PROBE_EVERY // 4 and min(seen[first + 1:]) >= 0


def test_the_first_look_at_a_large_batch_is_a_probe():
    """No draft verified yet, at a batch of 64 whose proposer must catch up on every request's context
    (40 plain steps' time): the first look is a probe of a few requests, not that whole catch-up, so at
    acceptance 0 a run of 512 steps (a benchmark's length) keeps 97% of plain steps' rate; where drafts
    are accepted, the probe costs at most 2% of what a whole first look gains."""
    from tp_engine.speculative.policy import SpecPolicy

    cost = {"switch": 40.0, "behind": 128}
    seen, rate = drive(SpecPolicy(4, adaptive=True), 64, 512, cost=1.0, gain=0.0, **cost)
    assert seen[:2] == [0, -1] and rate >= 0.97, (rate, [i for i, k in enumerate(seen) if k])
    _, probing = drive(SpecPolicy(4, adaptive=True), 64, 512, cost=0.1, gain=0.9, **cost)
    whole = SpecPolicy(4, adaptive=True)
    whole.probe_rows = 64  # a probe as large as the batch: the first look is a whole one
    seen, looking = drive(whole, 64, 512, cost=0.1, gain=0.9, **cost)
    assert seen[:3] == [0, 1, 1] and probing >= 0.98 * looking, (probing, looking)


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_a_proposer_catching_up_is_timed_as_a_switch(models, hf, method):
    """A model proposer's first step on a request (its prompt), and its first after plain steps, catch it up
    first: the policy gets those times as switches (record_switch), the steps after them as k's rate; the
    output is still transformers' greedy one."""
    spec = spec_of(models, method, 2, adaptive=True)
    llm = LLM(model=str(models["target"]), device="cpu", speculative=spec)
    policy, got = llm.engine.spec.policy, []
    script = iter([1, 1] + [0] * 8 + [2, 2])
    policy.choose = lambda batch: next(script, 0)
    policy.record = lambda batch, k, gained, seconds: got.append(("rate", k)) if k else None
    policy.record_switch = lambda batch, k, gained, seconds: got.append(("switch", k))
    try:
        (out,) = llm.generate([{"input_ids": PROMPTS[0]}], SamplingParams(max_new_tokens=NEW))
    finally:
        llm.shutdown()
    assert got == [("switch", 1), ("rate", 1), ("switch", 2), ("rate", 2)]
    assert out["output_token_ids"] == hf[0]


@pytest.mark.parametrize("method", ["draft_self", "eagle3"])
def test_a_catch_up_past_the_step_budget_goes_on_beside_drafting_requests(models, method):
    """A proposer's catch-up on a long prompt larger than a step's prompt budget (max_prefill_tokens) runs
    part of the way and drafts nothing that step, beside a request that drafts; it goes on the next step, and
    greedy output is transformers' own. The model as its own draft still has every draft accepted: each
    request's next drafting forward reads its own draft."""
    prompts = [PROMPTS[0], [(7 * i) % 500 + 2 for i in range(60)]]
    outs, counts = generate(models, method, {"max_new_tokens": NEW}, prompts=prompts, max_prefill_tokens=16)
    assert [o["output_token_ids"] for o in outs] == hf_generate(models["target"], prompts, NEW)
    assert counts["spec_share"] > 0.5
    if method == "draft_self":
        assert counts["acceptance_rate"] == 1.0, counts


def test_the_latency_profile_breaks_a_speculating_step_down(tmp_path):
    """launch/bench.py --workload latency --profile with a draft model: per verifying step, the time spent
    drafting (the catch-up included), verifying and taking the tokens, and how many steps caught up."""
    out = tmp_path / "bench.json"
    demo = ROOT / "configs" / "models"
    cmd = [sys.executable, str(ROOT / "launch" / "bench.py"), "--model", str(demo / "demo"), "--workload",
           "latency", "--engine", "ours", "--set", "device=cpu", "--new-tokens", "24", "--profile",
           "--set", "speculative.method=draft", "--set", f"speculative.model={demo / 'demo-draft'}",
           "--set", "speculative.adaptive=false", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = json.loads(out.read_text())["latency"]["spec_us_per_verifying_step"]
    assert spec.keys() == {"draft", "verify", "take", "verifying_steps", "switches", "tokens"}, spec
    assert 0 < spec["verifying_steps"] <= 24 and spec["switches"] >= 1 and spec["draft"] > 0, spec


def test_a_probe_drafts_for_a_few_requests_and_times_no_k(models, hf):
    """A probe step (policy.probe set by `choose`) drafts for the probe_rows requests whose proposers are
    least behind; the policy counts their drafts (the acceptance) but gets no time for k; output is
    transformers' greedy."""
    llm = LLM(model=str(models["target"]), device="cpu", speculative=spec_of(models, "draft_self", 2, True))
    policy, counted, timed = llm.engine.spec.policy, [], []
    policy.probe_rows = 2
    # a switch and its measure, two plain steps, then a probe of 2 drafts: (k, probe)
    script = iter([(1, False), (1, False), (0, False), (0, False), (2, True)])
    count = policy.count

    def choose(batch: int) -> int:
        k, probe = next(script, (0, False))
        policy.probe = policy.size_class(batch) if probe else None
        return k

    def count_(drafted: int, accepted: int, rows: int) -> None:
        counted.append((drafted, accepted, rows, policy.probe is not None))
        count(drafted, accepted, rows)
    policy.choose, policy.count = choose, count_
    policy.record = lambda batch, k, gained, seconds: timed.append(k) if k else None
    policy.record_switch = lambda batch, k, gained, seconds: timed.append(k)
    try:
        outs = llm.generate([{"input_ids": p} for p in PROMPTS], SamplingParams(max_new_tokens=NEW))
    finally:
        llm.shutdown()
    assert [o["output_token_ids"] for o in outs] == hf
    probes = [c for c in counted if c[3]]
    assert probes == [(4, 4, 2, True)], counted[:8]  # two requests drafted 2 each, all accepted
    assert timed == [1, 1], timed  # the switch and its measure; not the probe
