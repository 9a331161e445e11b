"""The command line's choices come from the stages' registries: registering a placement policy
or a GNN model is what makes `moment place --policy` / `moment train --model` accept it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moment.cli import build_parser, main
from moment.errors import UsageError
from placement.policies import POLICIES, get_policy

PLACE = ["place", "--plan", "p.json", "--dataset", "d", "--out", "o"]


def test_a_registered_policy_is_a_cli_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(POLICIES, "spread", POLICIES["hash"])
    assert build_parser().parse_args([*PLACE, "--policy", "spread"]).policy == "spread"
    assert get_policy("spread") is POLICIES["hash"]


def test_an_unknown_policy_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([*PLACE, "--policy", "nope"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'nope' (choose from 'ddak', 'hash')" in err
    with pytest.raises(UsageError, match="--policy 'nope': expected ddak or hash"):
        get_policy("nope")


def test_a_registered_model_is_a_choice_of_both_command_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer import config
    from trainer.models import LAYERS, Layer

    monkeypatch.setitem(LAYERS, "gcn", Layer(LAYERS["sage"], hidden=48))
    assert build_parser().parse_args(["train", "--data", "d", "--model", "gcn"]).model == "gcn"
    cfg = config.from_args(["--data", "d", "--model", "gcn"], raising=True)
    assert (cfg.model, cfg.hidden) == ("gcn", 48)  # its registered width is the default
    with pytest.raises(UsageError, match="invalid choice: 'nope'"):
        config.from_args(["--data", "d", "--model", "nope"], raising=True)


def test_building_the_parser_loads_neither_torch_nor_numba() -> None:
    """The registries sit beside torch and numba code; `moment --help` and `moment plan` must not
    pay for importing them."""
    probe = (
        "import sys; from moment.cli import build_parser; build_parser(); "
        "print(sorted({'torch', 'numba'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_a_registered_max_flow_engine_is_a_choice_of_plan_and_score(monkeypatch: pytest.MonkeyPatch) -> None:
    from moment.planner.flow.engines import MAX_FLOW_ENGINES

    monkeypatch.setitem(MAX_FLOW_ENGINES, "mine", MAX_FLOW_ENGINES["networkx"])
    for verb in ("plan", "score"):
        assert build_parser().parse_args([verb, "--profile", "p", "--engine", "mine"]).engine == "mine"


def test_train_options_are_the_configs(capsys: pytest.CaptureFixture[str]) -> None:
    """`moment train` offers every trainer option with the trainer's default (one declaration:
    trainer.config.TrainConfig), and hands the ranks what parses back to the same config."""
    from moment.options import to_argv
    from trainer.config import TrainConfig, from_args

    args = build_parser().parse_args(["train", "--data", "d", "--fanouts", "5,3", "--device", "cpu"])
    cfg = TrainConfig(data="d", fanouts=(5, 3), device="cpu")
    assert from_args(to_argv(args, TrainConfig)) == cfg == from_args(to_argv(cfg))
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {TrainConfig(data='d').epochs})" in text
