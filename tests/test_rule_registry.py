"""The rule registry: a rule is one file in lit_gmc/rules/, and the CLI, --help, the README's table and the sweep
read the registry, so a new file needs no other edit."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from test_plots import load_script

import lit_gmc.rules
from lit_gmc.__main__ import run
from lit_gmc.tblog import read_scalars

rules_table = load_script("rules_table")
sweep = load_script("sweep")

NEW_RULE = '''
"""Scaled importance sampling (a test's rule, added in this one file)."""

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import Correction, PolicyTerms


class ScaledIS(Correction):
    """ScaledIS: coefficient ``scale * rho_i``, leave-one-out advantages.

    Args:
        scale: Factor on every importance ratio.
        aggregation: Loss aggregation; ``null``: ``token_mean``.
    """

    threshold_option = "scale"
    default_aggregation = "token_mean"

    def __init__(self, scale: float = 0.5, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, scale=scale)

    @override
    def coefficients(self, terms: PolicyTerms, log_rho: Tensor) -> Tensor:
        return self.scale * O.is_coefficients(log_rho)
'''


@pytest.fixture
def new_rule_file(tmp_path, monkeypatch):
    """``scaled_is.py`` as one more file of the lit_gmc.rules package (its folder joins the package's path), imported
    as the package's import imports each of its files; removed again afterwards."""
    folder = tmp_path / "rules"
    folder.mkdir()
    (folder / "scaled_is.py").write_text(textwrap.dedent(NEW_RULE))
    monkeypatch.setattr(lit_gmc.rules, "__path__", [*lit_gmc.rules.__path__, str(folder)])
    yield lit_gmc.rules.registered()
    vars(lit_gmc.rules).pop("ScaledIS", None)
    sys.modules.pop("lit_gmc.rules.scaled_is", None)


def test_a_new_rule_file_trains_by_its_name_and_appears_in_help_the_readme_table_and_the_sweep(
    new_rule_file, tmp_path, capsys
):
    assert "ScaledIS" in new_rule_file and list(new_rule_file) == sorted(new_rule_file)
    with pytest.raises(SystemExit) as done:
        run(["fit", "--help"])
    assert done.value.code == 0 and "lit_gmc.rules.ScaledIS" in capsys.readouterr().out

    torch.set_num_threads(1)
    run(["fit", "--model.correction", "ScaledIS", "--model.correction.scale", "0.25", "--trainer.max_steps", "2",
         f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.logger.init_args.name=scaled",
         "--trainer.enable_progress_bar=false"])  # fmt: skip
    scalars = read_scalars(tmp_path / "scaled" / "version_0")
    assert [value for _, value in scalars["correction/eps"]] == [0.25, 0.25]  # its threshold, logged every update
    assert len(scalars["train/loss"]) == 2

    row = "| `ScaledIS` | Scaled importance sampling (a test's rule, added in this one file). | ScaledIS: coefficient "
    assert (
        row + "`scale * rho_i`, leave-one-out advantages. | `scale` = 0.5 | `token_mean` |"
        in rules_table.table(lit_gmc.rules.registered()).splitlines()
    )
    assert sweep.rule_class_path("scaledis") == "lit_gmc.rules.ScaledIS"
    args = sweep.parse_args(
        ["run", "--out", "x", "--max-steps", "2", "--checkpoint-every", "2", "--methods", "scaledis"]
    )
    assert [spec.name for spec in sweep.expand_grid(args)][0].startswith("scaledis-")  # accepted as a grid axis


def test_the_readme_table_is_the_registry():
    assert rules_table.main(["--check"]) == 0, "run python scripts/rules_table.py"
    assert list(lit_gmc.rules.registered()) == ["A3PO", "CISPO", "DPPO", "GAC", "GMC", "GRPO", "GSPO", "GeoMIS", "GeoTIS",
                                                "IS", "IcePop", "M2PO", "SeqMIS", "SeqTIS", "TIC", "TIS", "VCPO"]


def test_every_rule_checks_its_threshold_in_its_constructor_and_logs_it():
    for name, rule in lit_gmc.rules.registered().items():
        if rule.threshold_option is None:
            assert rule().threshold is None
            continue
        with pytest.raises(ValueError, match=rf"invalid {name} options: {rule.threshold_option}=-1.0 must be finite"):
            rule(**{rule.threshold_option: -1.0})
        assert rule().threshold == getattr(rule(), rule.threshold_option)


def test_an_option_a_rule_does_not_take_is_refused_in_python_too():
    with pytest.raises(ValueError, match="invalid GRPO options: clp is not an option of GRPO"):
        lit_gmc.rules.GRPO(clp=0.3)  # GRPO passes a subclass's options on to the base, which still refuses a typo
