"""Thinking output: `reasoning` apart from `text` for chat templates that emit <think>...</think>."""
import shutil

import pytest

from helpers import make_checkpoint, run_cli
from tp_engine.llm import LLM
from tp_engine.frontend.reasoning import opens_thinking, split_reasoning
from tp_engine.sampling.sampler import SamplingParams

VOCAB = 384
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
PLAIN = THINKING.split("{% if enable_thinking")[0] + "{% endif %}"


def write_tokenizer(path, names, template):
    """A word-level tokenizer: id i is names[i]; decoding joins the words with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", chat_template=template)
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random model, and a prompt whose greedy output's tokens 0 and 3 occur once each in it and not in the
    prompt: the tokenizers below name them <think> and </think>."""
    root = tmp_path_factory.mktemp("think")
    ckpt = make_checkpoint(root / "m", vocab=VOCAB)
    llm = LLM(model=str(ckpt), device="cpu")
    for start in range(5, 200, 7):
        prompt = [start, start + 1, start + 2]
        out = llm.generate([prompt], SamplingParams(max_new_tokens=8))[0]["output_token_ids"]
        a, b = out[0], out[3]
        if a != b and out.count(a) == out.count(b) == 1 and a not in prompt and b not in prompt:
            return ckpt, prompt, out
    raise AssertionError("no suitable prompt")


def with_tokenizer(ckpt, path, out, template):
    shutil.copytree(ckpt, path)
    names = [f"w{i}" for i in range(VOCAB)]
    names[out[0]], names[out[3]] = "<think>", "</think>"
    write_tokenizer(path, names, template)
    return str(path)


def words(ids):
    return " ".join(f"w{i}" for i in ids)


@pytest.mark.slow
def test_reasoning_is_split_from_the_answer(model, tmp_path):
    ckpt, prompt, out = model
    thinking = with_tokenizer(ckpt, tmp_path / "t", out, THINKING)
    cfg = {"model": thinking, "chat": True, "prompts": [{"input_ids": prompt}],
           "sampling": {"max_new_tokens": 8}}
    proc, lines = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines[0]["output_token_ids"] == out
    assert lines[0]["reasoning"] == words(out[1:3]) and lines[0]["text"] == words(out[4:])
    # the length limit inside the think block: all reasoning
    short = run(thinking, prompt, max_new_tokens=3)
    assert short["reasoning"] == words(out[1:3]) and short["text"] == ""
    # chat: false, or a template without <think>: no field, the text as decoded
    decoded = f"<think> {words(out[1:3])} </think> {words(out[4:])}"
    nochat = run(thinking, prompt, chat=False)
    assert "reasoning" not in nochat and nochat["text"] == decoded
    plain = run(with_tokenizer(ckpt, tmp_path / "p", out, PLAIN), prompt)
    assert "reasoning" not in plain and plain["text"] == decoded


def test_messages_prompts_think_without_chat_true(model, tmp_path, monkeypatch):
    """`messages` always go through the chat template, so their output is split as with `chat: true` (the
    README's API example gives messages and leaves `chat` off); a text or ids prompt with chat off is not."""
    ckpt, prompt, out = model
    llm = LLM(model=with_tokenizer(ckpt, tmp_path / "t", out, THINKING), device="cpu")
    # the template's rendering of these messages, as ids: the prompt whose output is known
    monkeypatch.setattr(llm.prompts, "try_encode", lambda p: list(prompt))
    chat, ids = llm.generate([{"messages": [{"role": "user", "content": "hi"}]}, {"input_ids": prompt}],
                             SamplingParams(max_new_tokens=8))
    assert chat["output_token_ids"] == ids["output_token_ids"] == out
    assert chat["reasoning"] == words(out[1:3]) and chat["text"] == words(out[4:])
    assert "reasoning" not in ids


def test_constraint_holds_after_the_think_block(model, tmp_path, monkeypatch):
    """A chat prompt that opens a think block thinks freely (the greedy tokens up to </think>) and is
    constrained after it, its reasoning split from the constrained answer; one that leaves <think> to the
    model (Qwen3 with thinking on) may open the block as its first token, then the same; one that ends a
    think block already (thinking off), and an ids prompt with chat off, are constrained from their first
    token."""
    import json

    ckpt, prompt, out = model
    path = with_tokenizer(ckpt, tmp_path / "t", out, THINKING)
    eos = 0  # w0, the tokenizer's special unk token: decoding drops it
    word = next(i for i in range(1, VOCAB) if i not in out and i not in prompt)
    assert eos not in out and eos not in prompt
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    (tmp_path / "t" / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    (tmp_path / "t" / "generation_config.json").unlink(missing_ok=True)
    llm = LLM(model=path, device="cpu")
    opened = prompt + out[:1]  # the template's prompt ends with <think>

    # the template's rendering, as ids: a prompt that opens <think>, one that leaves it to the model, one
    # that ends an empty think block
    rendered = {"think": opened, "maybe": prompt, "off": prompt + [out[0], out[3]]}

    def encode(p):
        return list(p["input_ids"] if "input_ids" in p else rendered[p["messages"][0]["content"]])
    monkeypatch.setattr(llm.prompts, "try_encode", encode)
    chats = [{"messages": [{"role": "user", "content": c}]} for c in rendered]
    thinks, maybe, off, ids = llm.generate(chats + [{"input_ids": opened}],
                                           SamplingParams(max_new_tokens=16, choice=[f"w{word}"]))
    assert thinks["output_token_ids"] == out[1:4] + [word, eos]  # unconstrained greedy up to </think>
    assert maybe["output_token_ids"] == out[:4] + [word, eos]  # its greedy first token opens the block
    for thought in (thinks, maybe):
        assert (thought["reasoning"], thought["text"]) == (words(out[1:3]), f"w{word}")
        assert thought["constraint"] == "complete"
    assert off["output_token_ids"] == ids["output_token_ids"] == [word, eos]
    assert off["constraint"] == ids["constraint"] == "complete"


def run(model, prompt, chat=True, max_new_tokens=8):
    llm = LLM(model=model, device="cpu", chat=chat)
    return llm.generate([{"input_ids": prompt}], SamplingParams(max_new_tokens=max_new_tokens))[0]


def test_split_reasoning_rules():
    assert split_reasoning("<think>\nplan a\n</think>\n\nThe answer.") == ("plan a", "The answer.")
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    # the prompt opened it
    assert split_reasoning("still thinking", open_think=True) == ("still thinking", "")
    assert split_reasoning("thought</think> answer", open_think=True) == ("thought", "answer")
    assert split_reasoning("Just an answer.") == ("", "Just an answer.")  # thinking turned off in the prompt
    # no block open, in the prompt or the output: a </think> is the answer's text, not the end of reasoning
    assert split_reasoning("Wrap it in </think> tags.") == ("", "Wrap it in </think> tags.")
    assert split_reasoning("Sure. <think>x</think> y") == ("", "Sure. <think>x</think> y")
    # the answer keeps its first line's indentation (code); a <think> written inside the reasoning stays
    assert split_reasoning("<think>a</think>\n\n    x = 1\n") == ("a", "    x = 1\n")
    assert split_reasoning("<think>a</think>  \n \n  - item") == ("a", "  - item")
    assert split_reasoning("what <think> means</think>A tag.", open_think=True) == \
        ("what <think> means", "A tag.")
    assert split_reasoning("what <think> means", open_think=True) == ("what <think> means", "")
    assert split_reasoning("<think>\nwhat <think> is</think>ok") == ("what <think> is", "ok")
    # blanks alone after the block are no answer, not indentation to keep
    assert split_reasoning("<think>A</think>\n\n  ") == ("A", "")
    assert split_reasoning("<think>A</think> \n ") == ("A", "")


def test_only_the_generation_prompt_opens_thinking():
    """<think> (id 1) opens the answer's reasoning only where the template ends the prompt with it, not where
    a user's message mentions it."""
    decode = {1: "<think>", 2: "</think>", 3: "\n"}.get

    def opens(ids):
        return opens_thinking(ids, (1, 2), lambda t: "".join(decode(i, "x") for i in t))
    assert opens([5, 6, 1]) and opens([5, 1, 3, 3])  # the template wrote "<think>\n"
    assert not opens([5, 1, 6, 7, 3, 8])  # "what does <think> mean?", then the assistant's header
    assert not opens([5, 1, 6, 2, 3]) and not opens([5, 6])


def test_think_tags_that_decoding_skips_do_not_split(tmp_path):
    """Added tokens marked special in tokenizer.json are dropped by decoding even when the tokenizer does not
    list them among its special tokens: such <think> tags give no tags to split at (think_tags is None), so an
    answer is never all `reasoning` with `text` empty."""
    import json

    from transformers import AutoTokenizer
    from helpers import ROOT
    from tp_engine.frontend.reasoning import think_tags
    demo = ROOT / "configs" / "models" / "demo"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / f, tmp_path / f)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        t["special"] = t["special"] or t["content"] in ("<think>", "</think>")
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert "<think>" not in tok.all_special_tokens
    assert tok.decode([start, end], skip_special_tokens=True) == ""
    assert think_tags(tok) is None
    # as Qwen3's: kept in the text
    assert think_tags(AutoTokenizer.from_pretrained(str(demo))) == (start, end)
