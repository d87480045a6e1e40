"""resume: true on an output that does not exist runs every prompt, and says so: an `output` relative to
another working directory would otherwise repeat a whole job in silence."""
import logging

import torch

from helpers import ROOT
from tp_engine.cli import Preflight
from tp_engine.base.config import build_config
from tp_engine.frontend.prompts import read_prompts

DEMO = ROOT / "configs" / "models" / "demo"


def preflight(tmp_path, output):
    cfg = build_config(None, [f"model={DEMO}", "prompts=[Alice, Down]", f"output={output}", "resume=true"])
    run = Preflight(cfg, read_prompts(cfg), None)
    try:
        run(torch.device("cpu"))
    finally:
        run.lock.release()
    return run


def test_resume_of_a_missing_output_says_nothing_is_resumed(tmp_path, caplog):
    out = tmp_path / "results.jsonl"
    with caplog.at_level(logging.WARNING, logger="tp_engine"):
        run = preflight(tmp_path, out)
    assert not run.sink.done_keys
    assert any("nothing to resume" in r.getMessage() and str(out) in r.getMessage() for r in caplog.records)


def test_resume_of_an_existing_output_is_quiet(tmp_path, caplog):
    out = tmp_path / "results.jsonl"
    out.write_text("")
    with caplog.at_level(logging.WARNING, logger="tp_engine"):
        preflight(tmp_path, out)
    assert not any("nothing to resume" in r.getMessage() for r in caplog.records)
