#!/usr/bin/env python
"""Train the tiny demo checkpoint in configs/models/demo/ from launch/data/corpus.txt.

The result is a small Qwen3ForCausalLM (about 1M parameters, float32) with its own byte-level
BPE tokenizer and a Qwen3-style chat template. It memorises the corpus (the first three chapters
of "Alice's Adventures in Wonderland"), so greedy decoding of a phrase from the text continues
with the words that follow it in the book: readable output that is easy to check by eye.

The run is deterministic: with the same torch version on the same kind of CPU, the same command
gives byte-identical files.

    python launch/train_demo_model.py                 # writes configs/models/demo/
    python launch/train_demo_model.py --out /tmp/demo --steps 200

With --draft it trains a draft model for speculative decoding instead: the demo's tokenizer files,
copied unchanged, and a smaller Qwen3 (about a fifth of the parameters) taught to predict the demo
model's next-token distribution on the corpus. It reports how often its greedy token is the demo's.

    python launch/train_demo_model.py --draft         # writes configs/models/demo-draft/
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "launch" / "data" / "corpus.txt"
DEFAULT_OUT = REPO / "configs" / "models" / "demo"
DRAFT_OUT = REPO / "configs" / "models" / "demo-draft"

VOCAB_SIZE = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
THINK = ["<think>", "</think>"]  # ordinary added tokens (kept by decode), as in Qwen3: the last two ids
# Qwen2/Qwen3's pre-tokenizer split (runs of newlines stay together, digits are split one by one).
SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen3's template, reduced to plain role/content messages: each message is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens an assistant turn and,
# with enable_thinking=false, adds an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

MODEL_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# The draft: the same heads, a narrower and shallower stack (the embedding is most of its parameters).
DRAFT_SHAPE = dict(MODEL_SHAPE, hidden_size=64, num_hidden_layers=2, intermediate_size=128)

# Beginnings of well-known sentences; the ones the trained model continues correctly are reported.
DEMO_CANDIDATES = [
    "Alice was beginning to get very tired of sitting by her sister",
    "Down, down, down. Would the fall",
    "'Curiouser and curiouser!' cried Alice",
    "In another moment down went Alice after it,",
    "There was nothing so VERY remarkable in that;",
    "So she was considering in her own mind",
    "'How doth the little crocodile",
    "They were indeed a queer-looking party",
    "The rabbit-hole went straight on like a tunnel for some way,",
    "Either the well was very deep, or she fell very slowly,",
]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)


def read_corpus() -> str:
    text = CORPUS.read_text(encoding="utf-8")
    text = re.sub(r"[ \t]+\n", "\n", text.replace("\r\n", "\n"))
    return text.strip("\n") + "\n"


# ---------------------------------------------------------------------------------------------- #
# tokenizer
# ---------------------------------------------------------------------------------------------- #
def train_tokenizer(text: str, out: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(THINK),
        min_frequency=1,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL):
        assert tok.token_to_id(t) == i

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    # The chat template lives in tokenizer_config.json (not a separate chat_template.jinja), as in Qwen3,
    # and the file uses the long-standing key names so that older transformers releases read it too.
    cfg_path, jinja = out / "tokenizer_config.json", out / "chat_template.jinja"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens", ["<|im_start|>", "<|im_end|>"])
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    if jinja.exists():
        jinja.unlink()

    # Checks: it loads as an ordinary local checkpoint tokenizer, the template renders, text round-trips.
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    got = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                 add_generation_prompt=True, enable_thinking=False)
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert got == want, repr(got)
    got = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                 add_generation_prompt=True)
    assert got == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(got)
    ids = hf(want, add_special_tokens=False)["input_ids"]
    assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>") and hf.convert_tokens_to_ids("<think>") in ids
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>" and len(hf) == VOCAB_SIZE
    assert hf.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n<think>\n\n</think>\n\n"
    # the backend tokenizer: the HF call warns of a text over its max length
    ids = hf.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert hf.decode(ids) == text, "tokenizer round trip failed"
    for piece in ("Hello, world!", "  two  spaces\n\nand\ttabs", "caf\u00e9 \u2014 na\u00efve"):
        assert hf.decode(hf(piece, add_special_tokens=False)["input_ids"]) == piece
    return hf, ids


# ---------------------------------------------------------------------------------------------- #
# model
# ---------------------------------------------------------------------------------------------- #
def copy_tokenizer(src: Path, out: Path, text: str):
    """The target's tokenizer files, copied unchanged (a draft shares its token ids), and the corpus' ids."""
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, out / name)
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert len(hf) == VOCAB_SIZE, len(hf)
    return hf, hf.backend_tokenizer.encode(text, add_special_tokens=False).ids


def make_model(tokenizer, shape: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        **shape,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        use_sliding_window=False,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config).float()
    return model, eot, im_end


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def space_stripped(tokenizer) -> dict[int, list[int]]:
    """Token id of " word" -> ids of "word": lets a window start the way a typed prompt does."""
    out = {}
    for i in range(len(tokenizer)):
        piece = tokenizer.decode([i])
        if len(piece) > 1 and piece[0] == " " and not piece[1].isspace():
            out[i] = tokenizer.backend_tokenizer.encode(piece[1:], add_special_tokens=False).ids
    return out


def make_batch(data: torch.Tensor, strip: dict[int, list[int]], batch: int, ctx: int, gen: torch.Generator,
               strip_prob: float) -> torch.Tensor:
    """Random windows of ctx + 1 tokens; in some, a leading " word" token is replaced by "word"."""
    extra = 4
    starts = torch.randint(0, len(data) - ctx - extra, (batch,), generator=gen)
    coins = torch.rand(batch, generator=gen)
    rows = []
    for s, c in zip(starts.tolist(), coins.tolist()):
        row = data[s:s + ctx + 1 + extra].tolist()
        if c < strip_prob and row[0] in strip:
            row = strip[row[0]] + row[1:]
        rows.append(row[:ctx + 1])
    return torch.tensor(rows, dtype=torch.long)


def train(model, ids: list[int], strip: dict[int, list[int]], steps: int, batch: int, ctx: int,
          peak_lr: float, seed: int, log_every: int, strip_prob: float = 0.25, teacher=None):
    """AdamW on random windows: next-token loss on the corpus, or with a teacher, the divergence of the
    model's next-token distribution from the teacher's at every position (distillation)."""
    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.98), eps=1e-8)
    warmup = max(1, min(100, steps // 10))
    model.train()
    t0, running = time.time(), None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, warmup)
        window = make_batch(data, strip, batch, ctx, gen, strip_prob)
        logits = model(input_ids=window[:, :-1]).logits.reshape(-1, VOCAB_SIZE)
        if teacher is None:
            loss = torch.nn.functional.cross_entropy(logits, window[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                want = teacher(input_ids=window[:, :-1]).logits.reshape(-1, VOCAB_SIZE).log_softmax(-1)
            loss = torch.nn.functional.kl_div(logits.log_softmax(-1), want, log_target=True,
                                              reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:5d}/{steps}  loss {loss.item():.4f}  (avg {running:.4f})  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {time.time() - t0:6.1f}s", flush=True)
    model.eval()
    return loss.item(), time.time() - t0


@torch.no_grad()
def full_loss(model, ids: list[int], ctx: int) -> float:
    """Mean next-token loss over the whole corpus, in consecutive windows."""
    data = torch.tensor(ids, dtype=torch.long)
    total, count = 0.0, 0
    for s in range(0, len(data) - 1, ctx):
        w = data[s:s + ctx + 1][None]
        logits = model(input_ids=w[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
        count += w.shape[1] - 1
    return total / count


@torch.no_grad()
def agreement(model, target, ids: list[int], ctx: int) -> float:
    """Fraction of the corpus' positions (consecutive windows) where the model's greedy next token is the
    target's."""
    data = torch.tensor(ids, dtype=torch.long)
    same, count = 0, 0
    for s in range(0, len(data) - 1, ctx):
        w = data[s:s + ctx][None]
        same += (model(input_ids=w).logits.argmax(-1) == target(input_ids=w).logits.argmax(-1)).sum().item()
        count += w.shape[1]
    return same / count


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, n: int) -> str:
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:])


def evaluate(model, tokenizer, text: str, seed: int, n_phrases: int = 10, prompt_words: int = 8,
             new_tokens: int = 20):
    rng = random.Random(seed)
    words = [m.start() for m in re.finditer(r"\S+", text)]
    hits = 0
    print(f"\nmemorisation: {n_phrases} phrases of {prompt_words} words, {new_tokens} greedy tokens each")
    phrases = 0
    while phrases < n_phrases:
        # A phrase that ends before a space, so the prompt's last token is the one the corpus has there.
        i = rng.randrange(0, len(words) - prompt_words - 60)
        start, end = words[i], words[i + prompt_words] - 1
        if text[end] != " ":
            continue
        phrases += 1
        prompt = text[start:end]
        cont = greedy(model, tokenizer, prompt, new_tokens)
        ok = text[end:].startswith(cont)
        hits += ok
        print(f"  [{'ok' if ok else 'MISS'}] {prompt!r} -> {cont!r}")
    print(f"memorisation score: {hits}/{n_phrases} continuations match the corpus exactly")

    print("\ndemo prompts (greedy, 40 tokens):")
    good = []
    for prompt in DEMO_CANDIDATES:
        pos = text.find(prompt)
        assert pos >= 0, prompt
        cont = greedy(model, tokenizer, prompt, 40)
        ok = text[pos + len(prompt):].startswith(cont)
        good += [(prompt, cont)] if ok else []
        print(f"  [{'ok' if ok else 'MISS'}] {prompt!r} -> {cont!r}")
    print("\ngood demo prompts:")
    for prompt, cont in good[:5]:
        print(f"  {prompt!r}\n      -> {cont!r}")
    return hits, good


def save(model, tokenizer, out: Path, eot: int, im_end: int) -> None:
    from transformers import GenerationConfig

    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot,
                                               do_sample=False)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and dtype == "float32", cfg
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, eot] and gen["do_sample"] is False, gen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help=f"output folder (default: {DEFAULT_OUT.relative_to(REPO)}, "
                         f"with --draft {DRAFT_OUT.relative_to(REPO)})")
    ap.add_argument("--draft", action="store_true",
                    help="train a draft model for --target (its tokenizer, a smaller Qwen3)")
    ap.add_argument("--target", type=Path, default=DEFAULT_OUT,
                    help=f"the model a draft is for (default: {DEFAULT_OUT.relative_to(REPO)})")
    ap.add_argument("--steps", type=int, default=2000, help="training steps (default: 2000)")
    ap.add_argument("--batch", type=int, default=16, help="windows per step (default: 16)")
    ap.add_argument("--ctx", type=int, default=128, help="tokens per window (default: 128)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--no-eval", action="store_true", help="skip the memorisation check")
    args = ap.parse_args(argv)

    seed_everything(args.seed)
    out = (args.out or (DRAFT_OUT if args.draft else DEFAULT_OUT)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    text = read_corpus()
    print(f"corpus: {CORPUS.relative_to(REPO)}, {len(text)} characters")

    target = None
    if args.draft:
        from transformers import Qwen3ForCausalLM
        tokenizer, ids = copy_tokenizer(args.target.resolve(), out, text)
        target = Qwen3ForCausalLM.from_pretrained(str(args.target.resolve()), dtype=torch.float32).eval()
    else:
        tokenizer, ids = train_tokenizer(text, out)
    print(f"tokenizer: {len(tokenizer)} tokens, corpus = {len(ids)} tokens")

    shape = DRAFT_SHAPE if args.draft else MODEL_SHAPE
    model, eot, im_end = make_model(tokenizer, shape)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3ForCausalLM, {n_params} parameters, {json.dumps(shape)}")
    loss, secs = train(model, ids, space_stripped(tokenizer), args.steps, args.batch, args.ctx, args.lr,
                       args.seed, args.log_every, teacher=target)
    corpus_loss = full_loss(model, ids, args.ctx)
    print(f"trained {args.steps} steps in {secs:.0f}s; last batch loss {loss:.4f}, "
          f"whole-corpus loss {corpus_loss:.4f}")
    if target is not None:
        print(f"greedy agreement with {args.target}: {agreement(model, target, ids, args.ctx):.4f}")

    save(model, tokenizer, out, eot, im_end)
    total = 0
    for f in sorted(out.iterdir()):
        total += f.stat().st_size
        print(f"  {f.name:28s} {f.stat().st_size:9d} bytes")
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    print(f"wrote {out} ({total / 2**20:.1f} MiB); model.safetensors sha256 {digest}")

    if not args.no_eval:
        evaluate(model, tokenizer, text, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
