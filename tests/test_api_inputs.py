"""The Python API's inputs and callbacks: prompt objects' keys, numpy and torch integers, messages in Python's
words, and what `on_token` receives. In-process, on the demo model: no torchrun."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from helpers import ROOT

DEMO = ROOT / "configs" / "models" / "demo"
ALICE = "Alice was beginning to get very tired"  # the demo model goes on " of sitting by her sister"


@pytest.fixture(scope="module")
def llm():
    from tp_engine.llm import LLM
    llm = LLM(model=str(DEMO), device="cpu")
    yield llm
    llm.shutdown()


def test_a_prompt_objects_unknown_key_is_its_error_naming_the_key_meant(llm, tmp_path):
    """A key a prompt object does not take (an option that goes in `sampling`, a typo) is that prompt's error,
    naming the key and the closest known one, in the API and in prompts_file; the other prompts run."""
    from tp_engine.base.config import ConfigError, build_config
    from tp_engine.frontend.prompts import PromptEncoder, PromptError, read_prompts
    from tp_engine.sampling.sampler import SamplingParams
    prompts = [{"prompt": ALICE, "max_tokens": 3}, {"input_id": [5, 6], "input_ids": [5, 6]}, ALICE]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=5))
    assert [o["finish_reason"] for o in outs] == ["error", "error", "length"]
    assert outs[0]["error"] == ("unknown key 'max_tokens' in a prompt object (its keys: 'prompt', "
                                "'input_ids', 'messages', 'sampling')")
    assert outs[1]["error"].startswith("unknown key 'input_id' in a prompt object; did you mean 'input_ids'?")
    pf = tmp_path / "prompts.jsonl"
    pf.write_text('{"prompt": "a", "max_tokens": 3}\n{"prompt": "b"}\n')
    cfg = build_config(model=str(DEMO), prompts_file=str(pf))
    got = PromptEncoder.from_config(cfg).encode_all(read_prompts(cfg))
    assert isinstance(got[0], PromptError) and str(got[0]).startswith("unknown key 'max_tokens'"), got[0]
    assert not isinstance(got[1], PromptError)
    pf.write_text('{"promt": "a"}\n')  # no prompt in it at all: the file is refused, naming the key meant
    with pytest.raises(ConfigError, match="line 1: expected an object .*unknown key 'promt' in a prompt "
                                          "object; did you mean 'prompt'"):
        read_prompts(cfg)


def test_numpy_and_torch_integers_are_token_ids_and_sampling_ints(llm):
    """numpy integers, 0-d and 1-d integer arrays and tensors are taken where Python ints are (token ids,
    SamplingParams' integers, stop_token_ids); the outputs hold Python ints. Bools and floats stay refused."""
    from tp_engine.base.config import ConfigError
    from tp_engine.sampling.sampler import SamplingParams
    ids = llm.encode(ALICE)
    params = SamplingParams(max_new_tokens=np.int64(4), top_k=np.int32(0), seed=np.uint8(3), n=np.int16(1),
                            logprobs=np.int64(0), stop_token_ids=np.array([7, 9]))
    assert (params.max_new_tokens, params.stop_token_ids) == (4, [7, 9])
    assert type(params.max_new_tokens) is int and type(params.stop_token_ids[0]) is int
    want = llm.generate([ids], SamplingParams(max_new_tokens=4))[0]["output_token_ids"]
    given = [np.array(ids), torch.tensor(ids), [np.int64(t) for t in ids], [torch.tensor(t) for t in ids],
             {"input_ids": np.array(ids, dtype=np.int32)}, {"input_ids": torch.tensor(ids)}]
    for prompt in given:
        (out,) = llm.generate(prompt, params)
        assert out["prompt_token_ids"] == ids and out["output_token_ids"] == want, type(prompt)
        json.dumps(out)  # Python ints only
    rows = llm.generate(torch.tensor([ids[:3], ids[1:4]]), params)  # 2-d: a prompt per row
    assert [o["prompt_token_ids"] for o in rows] == [ids[:3], ids[1:4]]
    bad_values = [{"max_new_tokens": np.float64(4)}, {"max_new_tokens": np.True_},
                  {"top_k": torch.tensor(True)}, {"stop_token_ids": [np.True_]},
                  {"stop_token_ids": np.array([1.5])}]
    for bad in bad_values:
        with pytest.raises(ConfigError, match="must be"):
            SamplingParams(**bad)
    outs = llm.generate([{"input_ids": np.array([1.0, 2.0])}, [np.True_, np.int64(5)]], params)
    assert outs[0]["error"] == "input_ids must be a list of integers"
    assert outs[1]["finish_reason"] == "error" and "YAML" not in outs[1]["error"]


def test_api_messages_speak_of_python_types_and_the_config_of_yaml(llm, tmp_path):
    """The API's prompts are Python values: a wrong one is named by its Python type with what to pass instead,
    without the config's advice to quote YAML, which a prompt read from YAML still gets."""
    from helpers import make_checkpoint

    from tp_engine.llm import LLM
    from tp_engine.frontend.prompts import PromptEncoder
    from tp_engine.sampling.sampler import SamplingParams
    with pytest.raises(TypeError) as err:
        llm.generate(5)
    assert str(err.value) == ("generate() takes a prompt (a str, a list of token ids or a dict) or a list of "
                              "prompts; got an int (5; a prompt of one token id is [5])")
    outs = llm.generate([5, 2.5, None, ALICE], SamplingParams(max_new_tokens=2))
    what = "; pass a str, a list of token ids or a dict"
    assert [o.get("error") for o in outs] == [
        "the prompt is an int (5; a prompt of one token id is [5])" + what, "the prompt is a float" + what,
        "the prompt is None" + what, None]
    assert "YAML reads an unquoted" in str(PromptEncoder(str(DEMO)).try_encode(5))  # the config's prompts
    bare = LLM(model=str(make_checkpoint(tmp_path / "m")), device="cpu")  # no tokenizer files
    with pytest.raises(ValueError) as err:
        bare.generate([[5, 6]], SamplingParams(max_new_tokens=2, stop=["ab"]))
    assert str(err.value).startswith("SamplingParams.stop needs the checkpoint's tokenizer")
    assert str(err.value).endswith("end requests with SamplingParams.stop_token_ids instead")
    bare.shutdown()


def test_on_token_gets_a_token_update_whose_text_never_shows_a_stop_string(llm):
    """on_token receives a TokenUpdate (index, sample, token ids and text so far, finish_reason at the last
    token), not the scheduler's request; its text holds back what could start a stop string, so it never runs
    past one, and the last update's text is the output's."""
    from tp_engine import TokenUpdate
    from tp_engine.sampling.sampler import SamplingParams
    updates = []
    outs = llm.generate([ALICE, "Down, down, down. Would the fall"],
                        SamplingParams(max_new_tokens=30, stop=[" her sister", "never"], n=2),
                        on_token=updates.append)
    for out in outs:
        mine = [u for u in updates if (u.index, u.sample) == (out["index"], out["sample"])]
        assert all(isinstance(u, TokenUpdate) for u in mine)
        assert [u.num_tokens for u in mine] == list(range(1, len(out["output_token_ids"]) + 1))
        assert mine[-1].token_ids == tuple(out["output_token_ids"]) and type(mine[-1].token_ids[0]) is int
        assert [u.finish_reason for u in mine] == [None] * (len(mine) - 1) + [out["finish_reason"]]
        texts = [u.text for u in mine]
        assert texts[-1] == out["text"]
        assert all(out["text"].startswith(t) for t in texts), texts  # never past the stop string
    first = [u for u in updates if (u.index, u.sample) == (0, 0)]
    assert outs[0]["text"] == " of sitting by" and outs[0]["finish_reason"] == "stop"
    assert first[-2].text == " of sitting by"  # " of sitting by her": " her" could start " her sister"
    with pytest.raises(dataclasses.FrozenInstanceError):
        first[0].index = 3


def test_token_update_text_holds_back_a_possible_stop_and_unfinished_characters():
    """The text grows by whole characters; at each step it holds back the longest end that a stop string
    starts with (and nothing else), and the text of an earlier update read late is still that update's."""
    from tp_engine.sampling.sampler import SamplingParams
    from tp_engine.runtime.request import RequestOutput
    from tp_engine.frontend.token_stream import TextStreams
    words = {1: "by", 2: " her", 3: " sis", 4: "ter", 5: "\ufffd", 6: "é"}
    decode = lambda ids: "".join(words[i] for i in ids).replace("\ufffdé", "é")
    texts = TextStreams(decode, [" sister", "r!"])
    req = RequestOutput(0, [1], SamplingParams())
    seen, shown = [], []
    for t in [1, 2, 5, 6, 3]:
        req.output_ids.append(t)
        seen.append(texts.update(req, None))
        shown.append(seen[-1].text)
    assert shown == ["by", "by he", "by he", "by heré", "by heré"]  # "r" could start "r!", " sis" " sister"
    assert seen[1].text == "by he" and seen[0].token_ids == (1,)  # read after later updates
    req.output_ids.append(4)
    req.text = "by heré"  # as StopStrings cuts it
    assert texts.update(req, "stop").text == "by heré"


def test_token_update_text_decodes_a_bounded_tail_of_a_long_output():
    """Each update decodes the ids after a settled point, not the whole output: a long output costs the same
    per token however far it has grown."""
    from tp_engine.sampling.sampler import SamplingParams
    from tp_engine.runtime.request import RequestOutput
    from tp_engine.frontend.token_stream import TextStreams
    table = {1: "a", 2: " b", 3: "\ufffd", 4: "é"}  # 3 then 4: a character split across two tokens
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return "".join(table[i] for i in ids).replace("\ufffdé", "é")
    texts = TextStreams(decode, ["zz"])
    req = RequestOutput(0, [1], SamplingParams())
    for i in range(3000):
        req.output_ids.append([1, 2, 3, 4][i % 4])
        text = texts.update(req, None).text
    assert text == decode(req.output_ids)
    assert sum(decoded) < 200 * len(req.output_ids)  # not the whole output at every token (4.5 million ids)
