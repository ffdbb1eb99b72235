"""The Samples callback: its markdown table and its options."""

from __future__ import annotations

import pytest

from lit_gmc.callbacks.samples import Samples, samples_table


def test_samples_table_escapes_what_markdown_would_break():
    table = samples_table(["1+2="], ["3|\n4"], [1.0], [8])
    assert table.splitlines()[-1] == "| 1+2= | 3\\|<br>4 | 1.000 | 8 |"


def test_samples_refuses_bad_options():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        Samples(every_n_steps=0)
