"""Checkpoint folders as users have them: which files are read, a tensor in two files, tied heads, config.json
fields left out; the same tokens as transformers wherever it reads them one way."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import hf_generate, make_checkpoint, run_cli
from tp_engine.llm import LLM
from tp_engine.comm import StartupError
from tp_engine.checkpoint.loader import CheckpointError, SliceSource, checkpoint_files
from tp_engine.sampling.sampler import SamplingParams

PROMPTS = [[5, 17, 300, 42, 8], [1, 2, 3]]
NEW = 8


def engine_greedy(path) -> list[list[int]]:
    llm = LLM(model=str(path), device="cpu")
    outs = llm.generate([{"input_ids": p} for p in PROMPTS], SamplingParams(max_new_tokens=NEW))
    return [o["output_token_ids"] for o in outs]


def index_of(path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def test_a_folder_saved_again_whole_reads_model_safetensors_not_its_stale_index(tmp_path):
    from transformers import Qwen3ForCausalLM
    path = make_checkpoint(tmp_path / "m", shard=True)
    Qwen3ForCausalLM.from_pretrained(path).save_pretrained(path)  # one file now; the old index stays behind
    assert (path / "model.safetensors").is_file() and (path / "model.safetensors.index.json").is_file()
    assert engine_greedy(path) == hf_generate(path, PROMPTS, NEW)


@pytest.mark.parametrize("index", [True, False])
def test_a_tensor_in_two_files_is_refused(tmp_path, index):
    """A tensor in two weight files is refused, naming both files: which copy transformers takes depends on
    its version (5.24 takes the stray copy whichever file it is in), so neither choice is safe."""
    path = make_checkpoint(tmp_path / "m", shard=True)
    weight_map = index_of(path)
    if not index:
        (path / "model.safetensors.index.json").unlink()
    files = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == files[0])
    tensors = load_file(path / files[-1])
    tensors[name] = torch.randn_like(load_file(path / files[0])[name])
    save_file(tensors, path / files[-1], metadata={"format": "pt"})
    with pytest.raises(StartupError, match=f"tensor '{name}' is in both {files[0]} and {files[-1]}"):
        LLM(model=str(path), device="cpu")


def _tied_with_head(path, head: str, drop_embedding: bool = False):
    """A tied checkpoint that also stores lm_head.weight: the embedding itself, or a different tensor."""
    make_checkpoint(path, tie=True)
    tensors = load_file(path / "model.safetensors")
    emb = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = emb.clone() if head == "same" else emb.flip(0).contiguous()
    if drop_embedding:
        del tensors["model.embed_tokens.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_tied_checkpoint_may_store_its_head(tmp_path):
    """The same values as the embedding load; the head alone fills the embedding, as in transformers."""
    for drop in (False, True):
        path = _tied_with_head(tmp_path / f"m{drop}", "same", drop_embedding=drop)
        assert engine_greedy(path) == hf_generate(path, PROMPTS, NEW), drop


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_tied_checkpoint_whose_head_differs_is_refused(tmp_path, tp):
    """transformers 5 unties such a head; the engine would use the embedding: one message, exit 2, no hang."""
    path = _tied_with_head(tmp_path / "m", "other")
    proc, lines = run_cli({"model": str(path), "prompts": [{"input_ids": PROMPTS[0]}]}, tmp_path, nproc=tp)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and not lines and len(errors) == 1, proc.stderr[-2000:]
    assert "lm_head.weight in model.safetensors differs from model.embed_tokens.weight, while config.json " \
           "sets tie_word_embeddings: true" in errors[0]
    assert 'tp_engine/' not in proc.stderr  # no traceback from the engine on any rank


@pytest.mark.parametrize("field,kw", [
    ("head_dim", dict(hidden=64, heads=4, kv_heads=2, head_dim=128)),
    ("num_key_value_heads", dict(hidden=64, heads=64, kv_heads=32, head_dim=4)),
])
def test_fields_config_json_leaves_out_take_transformers_defaults(tmp_path, field, kw):
    """Qwen3Config's defaults: head_dim 128 (not hidden / heads), num_key_value_heads 32."""
    path = make_checkpoint(tmp_path / "m", **kw)
    cfg = json.loads((path / "config.json").read_text())
    del cfg[field]
    (path / "config.json").write_text(json.dumps(cfg))
    assert engine_greedy(path) == hf_generate(path, PROMPTS, NEW)


def test_a_float64_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """float64 weights load, with transformers' tokens: transformers saves them, and the FP8 quantizer copies
    a float64 source's embeddings, norms and LM head as they are."""
    path = make_checkpoint(tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v.double() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    assert engine_greedy(path) == hf_generate(path, PROMPTS, NEW)


def test_an_index_with_an_empty_weight_map_is_named(tmp_path):
    """An index that lists no tensors is named as such, not taken for a folder without weights beside the
    shards it holds."""
    path = make_checkpoint(tmp_path / "m", shard=True)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json lists no tensors"):
        checkpoint_files(str(path))


def test_float8_tensors_in_a_module_kept_unquantized_name_the_key(tmp_path):
    save_file({"w": torch.zeros(2, 2).to(torch.float8_e4m3fn)}, tmp_path / "f.safetensors")
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as h, pytest.raises(ValueError) as e:
        SliceSource(h, "w")
    assert "modules_to_not_convert" in str(e.value)


def test_a_weight_file_that_is_a_broken_link_or_an_index_that_is_not_utf8_is_named(tmp_path):
    """A weight file that is a broken link (a cached snapshot whose blob is gone) is named as unreadable, not
    as missing from an index that does not exist; an index that is not UTF-8 is named, not a bare codec
    error."""
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "gone")
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable file"):
        checkpoint_files(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError,
                       match="model.safetensors.index.json is not a valid safetensors index"):
        checkpoint_files(str(tmp_path))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for key in [k for k, v in changes.items() if v is ...]:
        del cfg[key]
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes", [{"use_sliding_window": True},  # sliding_window null, as Qwen3 ships it
                                     # layer_types: all full
                                     {"use_sliding_window": True, "sliding_window": 4},
                                     {"use_sliding_window": True, "sliding_window": 4, "layer_types": ...}])
def test_use_sliding_window_where_no_layer_slides_loads_as_transformers_runs_it(tmp_path, changes):
    """use_sliding_window true where transformers slides no layer (a window of 4 would change its tokens)
    loads with full attention, as transformers runs it: the same tokens."""
    path = make_checkpoint(tmp_path / "m")  # 2 layers; max_window_layers 28
    _edit_config(path, **changes)
    assert engine_greedy(path) == hf_generate(path, PROMPTS, NEW)


@pytest.mark.parametrize("changes", [{"layer_types": ["full_attention", "sliding_attention"]},
                                     {"layer_types": ..., "max_window_layers": 1}])
def test_a_layer_with_a_sliding_window_is_refused_naming_it(tmp_path, changes):
    path = make_checkpoint(tmp_path / "m")
    _edit_config(path, use_sliding_window=True, sliding_window=4, **changes)
    with pytest.raises(StartupError, match=r"config.json: sliding-window attention is not supported "
                                           r"\(use_sliding_window=true with sliding_window=4 makes layer 1 "
                                           r"use it\)"):
        LLM(model=str(path), device="cpu")


def test_an_absent_sliding_window_is_transformers_default_window(tmp_path):
    """Without the key, transformers' window is 4096 (null means none): layer 1 slides here."""
    path = make_checkpoint(tmp_path / "m")
    _edit_config(path, use_sliding_window=True, sliding_window=..., layer_types=..., max_window_layers=1)
    with pytest.raises(StartupError, match=r"sliding_window=4096 makes layer 1 use it"):
        LLM(model=str(path), device="cpu")


def test_rope_scaling_beside_rope_parameters_is_what_transformers_uses(tmp_path):
    """transformers 5 writes rope_parameters; a rope_scaling added beside it (as Qwen's model cards describe
    for YaRN) replaces it there, so the engine reads it too: YaRN is refused by name rather than run as
    default RoPE with other tokens, and a rope_scaling without rope_theta takes the top-level one, as
    transformers does."""
    path = make_checkpoint(tmp_path / "yarn")
    _edit_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 128})
    with pytest.raises(StartupError, match="rope scaling type 'yarn' is not supported"):
        LLM(model=str(path), device="cpu")
    # the same rule for rope_theta: a rope_scaling without it takes the top-level one (or 10000), as
    # transformers does
    path = make_checkpoint(tmp_path / "theta")
    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                 rope_scaling={"type": "default"})
    assert engine_greedy(path) == hf_generate(path, PROMPTS, NEW)
