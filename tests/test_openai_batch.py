"""OpenAI Batch API request files as prompts_file: each request's settings, its output line in the Batch API's
output format, bad lines as 400 lines, refusals at start-up, one warning for unapplied fields, resume by
custom_id."""
import json

import pytest

from helpers import ROOT, hf_generate, run_cli
from tp_engine.base.config import ConfigError, build_config
from tp_engine.frontend.prompts import read_prompts
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams

DEMO = ROOT / "configs" / "models" / "demo"
ALICE = "Alice was beginning to get very tired"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def request(cid, url, **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


REQUESTS = [
    request("chat-1", CHAT, model="my-model", messages=[{"role": "user", "content": [{"type": "text",
                                                                                    "text": ALICE}]}],
            max_completion_tokens=6, logprobs=True, top_logprobs=2, presence_penalty=0.5),
    request("cmpl-1", COMPLETIONS, prompt="Alice was", max_tokens=5, temperature=1.0, top_k=-1, n=2, seed=3,
            logprobs=1, frequency_penalty=0.1, presence_penalty=0.0),
    request("bad-url", "/v1/embeddings", input="x"),
    request("cmpl-ids", COMPLETIONS, prompt=[5, 6, 7, 8], max_tokens=4),
    request("bad-value", COMPLETIONS, prompt="x", temperature="hot"),
    request("cmpl-stop", COMPLETIONS, prompt=ALICE, max_tokens=30, stop=" sister"),
]


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def config(tmp_path, lines, name="requests"):
    return {"model": str(DEMO), "prompts_file": str(write(tmp_path / f"{name}.jsonl", lines))}


def engine_outputs(prompts, params):
    """What the engine gives each prompt with those settings as the call's."""
    llm = LLM(model=str(DEMO), device="cpu")
    try:
        return [llm.generate(prompts, p, skip={j for j in range(len(prompts)) if j != i})
                for i, p in enumerate(params)]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_batch_file_round_trips_to_the_batch_output_format(tmp_path):
    """Chat and completion requests with their own settings, n > 1 and logprobs give one Batch API output
    line each, in input order, field by field as OpenAI's; greedy tokens equal transformers'; bad lines are
    400 lines while the others run; the unapplied body fields are named in one warning, with counts."""
    proc, lines = run_cli(config(tmp_path, REQUESTS), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [x for x in proc.stderr.splitlines() if "does not apply" in x]
    assert len(warnings) == 1 and warnings[0].endswith(
        "body fields this engine does not apply are ignored: frequency_penalty (1 line), presence_penalty "
        "(2 lines)"), proc.stderr[-3000:]
    assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in REQUESTS]
    assert len({x["id"] for x in lines}) == len(lines)
    assert all(x["id"].startswith("batch_req_") for x in lines)
    assert all(x["error"] is None and x["response"]["request_id"] for x in lines)
    status = [x["response"]["status_code"] for x in lines]
    assert status == [200, 200, 400, 200, 400, 200]
    bodies = [x["response"]["body"] for x in lines]
    assert bodies[2]["error"]["type"] == bodies[4]["error"]["type"] == "invalid_request_error"
    assert "url must be /v1/chat/completions or /v1/completions; got '/v1/embeddings'" == \
        bodies[2]["error"]["message"]
    assert "temperature must be a number, got 'hot'" in bodies[4]["error"]["message"]
    chat, cmpl, ids, stop = bodies[0], bodies[1], bodies[3], bodies[5]
    assert (chat["object"], chat["model"]) == ("chat.completion", "my-model")
    assert (cmpl["object"], cmpl["model"]) == ("text_completion", "demo")  # no model given: the checkpoint's
    assert all(isinstance(b["created"], int) for b in (chat, cmpl, ids, stop))
    # the engine's own outputs for those prompts and settings, one request at a time
    want = engine_outputs(
        [{"messages": [{"role": "user", "content": ALICE}]}, "Alice was", [5, 6, 7, 8], ALICE],
        [SamplingParams(max_new_tokens=6, logprobs=2), SamplingParams(max_new_tokens=5, temperature=1.0, n=2,
                                                                       seed=3, logprobs=1),
         SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=30, stop=[" sister"])])
    (c0,), (s0, s1), (i0,), (t0,) = want
    choice = chat["choices"][0]
    assert len(chat["choices"]) == 1 and choice["index"] == 0
    assert choice["finish_reason"] == c0["finish_reason"]
    assert choice["message"] == {"role": "assistant", "content": c0["text"],
                                 "reasoning_content": c0.get("reasoning")}
    content = choice["logprobs"]["content"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    assert [e["token"] for e in content] == [tok.decode([e["token"]]) for e in c0["logprobs"]]
    for e, w in zip(content, c0["logprobs"]):
        assert abs(e["logprob"] - w["logprob"]) < 1e-4 and e["bytes"] == list(e["token"].encode())
        assert [t["token"] for t in e["top_logprobs"]] == [tok.decode([i]) for i, _ in w["top"]]
    assert chat["usage"] == {"prompt_tokens": len(c0["prompt_token_ids"]),
                             "completion_tokens": len(c0["output_token_ids"]),
                             "total_tokens": len(c0["prompt_token_ids"]) + len(c0["output_token_ids"])}
    assert [c["index"] for c in cmpl["choices"]] == [0, 1]
    assert [c["text"] for c in cmpl["choices"]] == [s0["text"], s1["text"]] and s0["text"] != s1["text"]
    assert cmpl["usage"]["completion_tokens"] == len(s0["output_token_ids"]) + len(s1["output_token_ids"])
    lp = cmpl["choices"][1]["logprobs"]
    assert lp["tokens"] == [tok.decode([e["token"]]) for e in s1["logprobs"]]
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in s1["logprobs"]], abs=1e-4)
    assert [list(t) for t in lp["top_logprobs"]] == [[tok.decode([e["top"][0][0]])] for e in s1["logprobs"]]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
    assert ids["choices"][0]["logprobs"] is None and ids["choices"][0]["text"] == i0["text"]
    assert (stop["choices"][0]["text"], stop["choices"][0]["finish_reason"]) == (" of sitting by her", "stop")
    # greedy: transformers' tokens (the stop request's, up to where the stop string ended it)
    ref = hf_generate(DEMO, [i0["prompt_token_ids"], t0["prompt_token_ids"]], 30)
    assert i0["output_token_ids"] == ref[0][:4]
    assert t0["output_token_ids"] == ref[1][:len(t0["output_token_ids"])]
    assert ids["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_resume_by_custom_id_completes_a_partly_written_output(tmp_path):
    """A resume keeps the lines already complete for their custom_id, runs again the 400 lines and the missing
    ones, and ends with the file of a whole run in input order, nothing lost or doubled; a request changed
    under its custom_id refuses the resume, naming it."""
    cfg = config(tmp_path, REQUESTS[1:4])
    proc, full = run_cli(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run.jsonl"
    text = out.read_text().splitlines()
    # the last line complete, the 400 line, and the first one cut short by a crash
    out.write_text(text[2] + "\n" + text[1] + "\n" + text[0][:40])
    proc, lines = run_cli({**cfg, "resume": True}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"resumed_skipped": 1' in proc.stderr and '"requests": 3' in proc.stderr  # cmpl-1's 2 samples too
    assert [x["custom_id"] for x in lines] == ["cmpl-1", "bad-url", "cmpl-ids"]
    assert lines[2] == full[2]  # kept as it was
    for line in (lines[0], full[0]):  # run again: the same but for its time
        line["response"]["body"]["created"] = 0
    assert lines[0] == full[0] and lines[1]["response"] == full[1]["response"]
    changed = [REQUESTS[1], REQUESTS[2], {**REQUESTS[3], "body": {**REQUESTS[3]["body"], "max_tokens": 2}}]
    proc, _ = run_cli({**config(tmp_path, changed), "resume": True}, tmp_path)
    assert proc.returncode == 2
    assert "line 3: custom_id 'cmpl-ids' was produced from another request or other settings" in proc.stderr


def test_a_duplicate_custom_id_or_a_mixed_file_is_refused_naming_the_lines(tmp_path):
    """Resume keys on custom_id: one given twice refuses the file at start-up naming both lines, and so does a
    file mixing Batch API requests with prompt objects, naming the line."""
    def read(lines):
        return read_prompts(build_config(**config(tmp_path, lines)))
    with pytest.raises(ConfigError, match=r"custom_id 'chat-1' is given twice, on lines 1 and 3; each"):
        read([REQUESTS[0], REQUESTS[1], REQUESTS[0]])
    with pytest.raises(ConfigError, match=r"line 2: not an OpenAI Batch API request .*one kind of line"):
        read([REQUESTS[0], {"prompt": "x"}])
    with pytest.raises(ConfigError, match=r"line 2: an OpenAI Batch API request, but the file's first line "):
        read([{"prompt": "x"}, REQUESTS[0]])
    with pytest.raises(ConfigError, match="line 1: custom_id must be a string; got int"):
        read([{**REQUESTS[0], "custom_id": 7}])
    batch = read(REQUESTS)
    assert batch[0] == {"messages": [{"role": "user", "content": ALICE}],
                        "sampling": {"max_new_tokens": 6, "logprobs": 2}}
    assert batch[1]["sampling"] == {"max_new_tokens": 5, "temperature": 1.0, "top_k": 0, "n": 2, "seed": 3,
                                    "logprobs": 1}
    assert batch[5]["sampling"] == {"max_new_tokens": 30, "stop": " sister"}
    assert [r["error"] is not None for r in batch.requests] == [False, False, True, False, False, False]
