"""The rule table (`fivefold.rules`) and parse-time choices (`fivefold.config`): checks of the data itself.

Every rule's ``fix`` names real config keys and its message names one of them, so a refusal
always says what to change; every `Literal` choice key refuses a value outside its choices when
the config is read, listing the valid ones, and takes each valid one. No processes.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from fivefold import rules
from fivefold.config import Config, ConfigError, _field_types, _sections, apply_overrides, choices


def _keys(prefix: str, cls: type) -> dict[str, typing.Any]:
    """Every dotted key below a section, nested sections (model.moe) included."""
    out: dict[str, typing.Any] = {}
    for name, tp in _field_types(cls).items():
        nested = next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)
        out.update(_keys(f"{prefix}{name}.", nested) if nested else {f"{prefix}{name}": tp})
    return out


KEYS = {k: tp for s, cls in _sections().items() for k, tp in _keys(f"{s}.", cls).items()}
# The moe section is also written model.moe (the name the messages use).
KEYS |= {f"model.{k}": tp for k, tp in KEYS.items() if k.startswith("moe.")}
CHOICE_KEYS = sorted(
    k for k, tp in KEYS.items() if choices(tp) is not None and not k.startswith("model.moe.")
)


@pytest.mark.parametrize("index", range(len(rules.RULES)))
def test_every_rule_names_real_keys_to_change(index: int) -> None:
    rule = rules.RULES[index]
    assert rule.fix, f"rule {index} names no key to change"
    unknown = [key for key in rule.fix if key not in KEYS]
    assert not unknown, f"rule {index}: {unknown} are not config keys"
    assert rule.group in ("", *rules.GROUPS)


def test_the_table_knows_every_choice_key() -> None:
    # The choice keys the issue names among them; a key silently losing its Literal fails here.
    for key in ("pipeline.overlap", "zero.stage", "train.recompute", "pipeline.p2p"):
        assert key in CHOICE_KEYS, key


@pytest.mark.parametrize("key", CHOICE_KEYS)
def test_a_choice_outside_its_values_is_refused_when_read(key: str) -> None:
    values = choices(KEYS[key])
    with pytest.raises(ConfigError) as err:
        bogus = 99 if isinstance(values[0], int) else "no-such-choice"
        apply_overrides(Config(), [f"--{key}", str(bogus)])
    message = str(err.value)
    assert message.startswith(key), message
    for value in values:
        assert str(value) in message, (value, message)


@pytest.mark.parametrize("key", CHOICE_KEYS)
def test_every_value_of_a_choice_is_taken(key: str) -> None:
    section, name = key.split(".")
    for value in choices(KEYS[key]):
        cfg = apply_overrides(Config(), [f"--{key}", str(value).lower()])
        assert getattr(getattr(cfg, section), name) == value
        assert typing.get_origin(KEYS[key]) is not None
