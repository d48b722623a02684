"""`fivefold --help` and `fivefold train --help`: every command with its line, every preset, every
key of the schema with its default, and where the keys are documented (no process started)."""

from __future__ import annotations

import dataclasses

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
    cfg = Config()
    for section in dataclasses.fields(Config):
        shown = "model.moe" if section.name == "moe" else section.name
        assert f"[{shown}]" in out
        for key in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), key.name)
            assert f"{key.name}={value!r}" in out or f"{key.name}={value}" in out, (shown, key.name)
    assert "docs/training.md" in out and "--resume" in out
