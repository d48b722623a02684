"""`fivefold --help` and `fivefold train --help`: every command with its line, every preset, every
key of the schema with its default, and where the keys are documented (no process started)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from fivefold.cli import COMMAND_HELP, COMMANDS, main
from fivefold.config import Config
from fivefold.models import PRESETS


def test_fivefold_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert COMMAND_HELP.get(name), f"{name} has no line in COMMAND_HELP"
        assert f"  {name} " in out and COMMAND_HELP[name] in out
    assert main(["nonsense"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'nonsense'" in err and "commands:" in err
    assert main([]) == 2 and "commands:" in capsys.readouterr().err


def test_train_help_lists_presets_every_key_and_the_docs(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse and textwrap break lines anywhere
    for name in PRESETS:
        assert name in out
    keys = out.split("keys (--section.key VALUE)", 1)[1].split("Each key is documented", 1)[0]
    cfg = Config()
    sections = [("model.moe" if s.name == "moe" else s.name, s.name) for s in dataclasses.fields(Config)]
    # each section's block: from its header to the next one (a key matched in its own section only)
    header = re.compile(r"\[(" + "|".join(re.escape(shown) for shown, _ in sections) + r")\]")
    parts = header.split(keys)
    blocks = dict(zip(parts[1::2], parts[2::2]))
    for shown, name in sections:
        assert shown in blocks, shown
        block = blocks[shown]
        for key in dataclasses.fields(getattr(cfg, name)):
            value = getattr(getattr(cfg, name), key.name)
            shapes = {f"{key.name}={value!r}", f"{key.name}={value}"}
            assert any(re.search(r"(?<![\w.])" + re.escape(s) + r"(?=[,\s]|$)", block) for s in shapes), (
                shown, key.name)
    assert "docs/training.md" in out and "--resume" in out
