"""The Python API's inputs: prompt objects' keys. In-process, on the demo model: no torchrun."""
import pytest

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
    """A key a prompt object does not take (an option meant per prompt, a typo) is that prompt's error, naming
    the key and the closest known one, in the API and in prompts_file; the other prompts run."""
    from tp_engine.config import ConfigError, build_config
    from tp_engine.prompts import PromptEncoder, PromptError, read_prompts
    from tp_engine.sampler import SamplingParams
    prompts = [{"prompt": ALICE, "max_tokens": 3}, {"input_id": [5, 6], "input_ids": [5, 6]}, ALICE]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=5))
    assert [o["finish_reason"] for o in outs] == ["error", "error", "length"]
    assert outs[0]["error"] == ("unknown key 'max_tokens' in a prompt object (its keys: 'prompt', "
                                "'input_ids', 'messages')")
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
