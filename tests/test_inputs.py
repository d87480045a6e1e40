"""Inputs read defensively: UTF-8 and JSONL lines. In-process: no torchrun."""
import json

import pytest

from helpers import ROOT
from tp_engine.cli import main
from tp_engine.config import build_config

DEMO = ROOT / "configs" / "models" / "demo"


def cli(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().err


def config_with_prompts_file(tmp_path, data: bytes):
    pf = tmp_path / "prompts.jsonl"
    pf.write_bytes(data)
    conf = tmp_path / "run.yaml"
    conf.write_text(f"model: {DEMO}\nprompts_file: {pf}\n")
    return conf, pf


# ---- YAML and JSONL ----

def test_config_file_that_is_not_utf8_names_file_line_and_column(tmp_path, capsys):
    conf = tmp_path / "run.yaml"
    conf.write_bytes(f"model: {DEMO}\nprompts:\n  - caf\xe9 au lait\n".encode("latin-1"))
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 2
    assert f"error: {conf} line 3: not valid UTF-8 (byte 0xe9 at column 8)" in err


def test_prompts_file_that_is_not_utf8_names_file_line_and_column(tmp_path, capsys):
    conf, pf = config_with_prompts_file(tmp_path, b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 2
    assert f"error: {pf} line 2: not valid UTF-8 (byte 0xe9 at column 16)" in err


def test_prompts_file_lines_end_at_newlines_only(tmp_path, capsys):
    # U+2028 may stand raw inside a JSON string; str.splitlines() would cut the line there. CRLF ends are fine.
    conf, pf = config_with_prompts_file(tmp_path, '{"prompt": "one\u2028two"}\r\n{"input_ids": [1, 2]}\n'.encode())
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 0, err
    from tp_engine.cli import read_prompts
    assert read_prompts(build_config(str(conf))) == [{"prompt": "one\u2028two"}, {"input_ids": [1, 2]}]
