"""benchmarks/l2_sections.py's wrapper of the launcher's walk_section (CPU: no kernel runs)."""

import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import l2_sections  # noqa: E402
from flashgen.families.gluon import config, launch  # noqa: E402


@pytest.fixture
def restore_walk_section():
    saved = launch.walk_section
    yield
    launch.walk_section = saved


def test_the_wrapper_takes_what_the_launcher_passes_and_logs_the_deal(restore_walk_section):
    log = []
    l2_sections.record_walks(log)
    wrapped = launch.walk_section
    assert list(inspect.signature(wrapped).parameters) == list(inspect.signature(config.walk_section).parameters)
    # the launcher's call (launch.py): positional, the config's snake last
    for snake in (False, True):
        args = (32, 4, 1024, 1024, 128, 128, "causal", -1024, 0, 128, 128, 132, snake)
        assert wrapped(*args) == config.walk_section(*args)
        entry = log[-1]
        assert entry["snake"] is snake and entry["section"] == config.walk_section(*args)
        work = tuple(config.key_tiles(m * 128, 128, 128, 1024, 1024, "causal", -1024, 0) + config.TILE_OVERHEAD
                     for m in range(8))
        assert entry["balance"] == config.walk_balance(work, 32, entry["section"], 132, snake)
    # 1x32/8x1024 at 1.9 rounds: the snake deal is the better balanced one
    assert log[-1]["balance"] < log[-2]["balance"]
