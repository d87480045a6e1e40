"""The table of every config key: its type, default, help text, choices and check (`SCHEMA`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tp_engine.base import config_checks as checks


@dataclass(frozen=True)
class Key:
    type: tuple  # accepted Python types
    default: Any
    help: str
    choices: tuple | None = None
    check: Any = None  # callable(value) -> error string or None


_INT, _FLOAT, _STR, _BOOL, _LIST, _NONE = (int,), (int, float), (str,), (bool,), (list,), (type(None),)

SCHEMA: dict[str, Key] = {
    "model": Key(
        _STR, None,
        "checkpoint directory (config.json + safetensors; tokenizer files for text prompts)"),
    "load_format": Key(
        _STR, "auto", "auto: safetensors from `model`; dummy: random weights from config.json alone",
        ("auto", "dummy")),
    "dtype": Key(
        _STR, "auto",
        "weights and activations; auto = the checkpoint's float16 or bfloat16 on CUDA (else "
        "bfloat16), float32 on CPU",
        ("auto", "float32", "float16", "bfloat16")),
    "device": Key(_STR, "auto", "auto = cuda if available, else cpu", ("auto", "cpu", "cuda")),
    "tensor_parallel_size": Key(
        _INT + _NONE, None,
        "ranks per model replica; the job's ranks form world size / tensor_parallel_size data-parallel "
        "replicas of consecutive ranks, each its own engine; default: all ranks, one replica",
        check=checks.positive),
    "seed": Key(_INT, 0, "seed for sampling and dummy weights, 0 <= seed < 2**32", check=checks.seed),
    "attention_backend": Key(
        _STR, "auto", "auto = flashinfer on CUDA, torch on CPU", ("auto", "flashinfer", "torch")),
    "cuda_graph": Key(_BOOL, True, "capture decode steps in CUDA graphs (CUDA only)"),
    "cuda_graph_max_batch": Key(
        _INT, 256, "largest decode batch captured in a CUDA graph", check=checks.positive),
    "cuda_graph_max_tokens": Key(
        _INT, 4096,
        "prompt and mixed steps of up to this many tokens run as CUDA graphs "
        "in pieces around attention (TP 1); 0 = eager",
        check=checks.non_negative),
    "max_batch_size": Key(_INT, 256, "most requests in one decode batch", check=checks.positive),
    "max_prefill_tokens": Key(
        _INT, 8192,
        "most tokens in one step, decode rows (one token each) included; a longer "
        "prompt is computed in chunks across steps while the others decode",
        check=checks.positive),
    "max_prefill_cost_while_decoding": Key(
        _INT, 4096,
        "while requests decode, the most prompt work in one step, in "
        "tokens that count their attention: a token at position c costs "
        "1 + c / (the model's attention span); 0 = no bound but max_prefill_tokens",
        check=checks.non_negative),
    "prefix_cache": Key(
        _BOOL, True, "share the KV pages of prompt prefixes between requests and generate calls"),
    "max_model_len": Key(
        _INT + _NONE, None, "longest prompt + output; default: max_position_embeddings",
        check=checks.positive),
    "kv_cache.page_size": Key(_INT, 16, "tokens per KV page", check=checks.positive),
    "kv_cache.num_pages": Key(
        _INT + _NONE, None,
        "KV pages; default: on CUDA what gpu_memory_utilization leaves "
        "(the memory plan), on CPU up to 1 GiB per rank",
        check=checks.positive),
    "kv_cache.gpu_memory_utilization": Key(
        _FLOAT, 0.9,
        "share of the GPU's memory the engine may hold (weights, "
        "largest step, CUDA graphs, KV pool); the rest stays free",
        check=checks.fraction),
    "sampling.temperature": Key(_FLOAT, 0.0, "0 = greedy", check=checks.temperature),
    "sampling.top_k": Key(_INT, 0, "keep the k most likely tokens; 0 = off", check=checks.non_negative),
    "sampling.top_p": Key(_FLOAT, 1.0, "nucleus sampling mass, in (0, 1]", check=checks.fraction),
    "sampling.max_new_tokens": Key(_INT, 64, "most tokens generated per prompt", check=checks.positive),
    "sampling.ignore_eos": Key(_BOOL, False, "keep generating past EOS tokens"),
    "sampling.stop_token_ids": Key(
        _LIST, [], "extra token ids that end a request", check=checks.id_list),
    "sampling.stop": Key(
        _LIST, [], "strings that end a request (the text is cut before them)", check=checks.stop_strings),
    "sampling.n": Key(
        _INT, 1, "samples per prompt, one output line each (the prompt is encoded once)",
        check=checks.positive),
    "sampling.logprobs": Key(
        _INT, 0,
        "log-probabilities of each output token and of the K most likely ones, "
        "0 <= K <= 20; 0 = off",
        check=checks.logprobs),
    "sampling.json_schema": Key(
        (dict, bool, type(None)), None,
        "constrain the output to JSON of this schema; true = any JSON object", check=checks.json_schema),
    "sampling.regex": Key(_STR + _NONE, None, "constrain the output to this regular expression",
                          check=checks.non_empty_text),
    "sampling.choice": Key(_LIST + _NONE, None, "constrain the output to one of these strings",
                           check=checks.choices),
    "sampling.grammar": Key(_STR + _NONE, None, "constrain the output to this EBNF grammar (xgrammar's)",
                            check=checks.non_empty_text),
    "speculative.method": Key(
        _STR + _NONE, None,
        "speculative decoding: eagle3 = an EAGLE-3 head, draft = a smaller Qwen3 with the same tokenizer, "
        "ngram = prompt lookup (no weights); null = off",
        check=checks.spec_method),
    "speculative.model": Key(
        _STR + _NONE, None, "the EAGLE-3 head's or the draft model's checkpoint directory"),
    "speculative.num_tokens": Key(
        _INT, 4, "most draft tokens a request verifies per step", check=checks.spec_tokens),
    "speculative.adaptive": Key(
        _BOOL, True,
        "speculate only while it pays: fewer draft tokens, or none, at large batches or low "
        "acceptance; false = always num_tokens"),
    "speculative.ngram_min": Key(_INT, 1, "ngram: the shortest suffix looked up", check=checks.positive),
    "speculative.ngram_max": Key(_INT, 4, "ngram: the longest suffix looked up", check=checks.positive),
    "prompts": Key(_LIST + _NONE, None, "list of strings or {input_ids: [...]} or {messages: [...]}"),
    "prompts_file": Key(
        _STR + _NONE, None,
        "JSONL file, one {prompt: str}, {input_ids: [...]} or {messages: [...]} per line"),
    "chat": Key(_BOOL, False, "wrap prompts with the tokenizer's chat template"),
    "chat_template_kwargs": Key(
        (dict,), {}, "extra template variables, e.g. {enable_thinking: false}",
        check=checks.template_kwargs),
    "output": Key(
        _STR + _NONE, None,
        "JSONL results file, one line per prompt, in input order; unset or "
        "\"-\": stdout"),
    "resume": Key(
        _BOOL, False, "keep `output`'s finished lines of this run's prompts and settings, run the rest"),
    "stream": Key(_BOOL, False, "print text as it is generated (a single prompt only)"),
    "progress": Key(_BOOL, True, "progress bar on a terminal, periodic log lines otherwise"),
    "fail_on_prompt_error": Key(
        _BOOL, False,
        "exit with status 3 when a prompt ends in error (false: 0, with a "
        "warning and the count in the summary)"),
    "timeout_s": Key(
        _INT, 300, "longest wait in a collective before the job is declared stuck", check=checks.timeout),
    "advanced.all_reduce": Key(
        _STR, "auto",
        "all-reduce of messages up to 512 KB on CUDA: auto = at TP 2 push, else "
        "symm, else nccl, at TP > 2 nccl; push = push, else symm, else nccl; symm = symm, "
        "else nccl",
        ("auto", "push", "symm", "nccl")),
    "advanced.fused_kernels": Key(
        _STR, "auto",
        "fused Triton kernels on CUDA: auto = used when Triton imports and their "
        "self-test passes on every rank; on = the same, but a failure stops the start-up; "
        "off = torch ops",
        ("auto", "on", "off")),
    "advanced.fp8_gemm": Key(
        _STR, "weight_only",
        "block-FP8 checkpoints on CUDA, matmuls of several tokens: weight_only "
        "= bf16 activations against the fp8 weights; w8a8 = activations quantized to fp8 per "
        "token and 128 columns, fp8 x fp8",
        ("weight_only", "w8a8")),
    "advanced.step_channel": Key(
        _STR, "auto",
        "how rank 0 sends each step's message: shm = a shared-memory mailbox "
        "(ranks on one x86 host), gloo = the CPU process group; auto = shm on CUDA where "
        "possible, else gloo",
        ("auto", "shm", "gloo")),
}
