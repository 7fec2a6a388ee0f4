"""The plan of least device memory (least_memory.py), and the scheduler's fallback to it when its
own search, deciding blocks in groups or cutting its partial plans, finds no plan that fits."""
from __future__ import annotations

import itertools
import random

import pytest

from strategies.memferry.cost import predict, predict_options
from strategies.memferry.least_memory import block_options, least_memory
from strategies.memferry.scheduler import GROUP_ABOVE, NoPlanFitsError, min_budget, schedule, unit_choices
from test_memferry_scheduler import _fix, random_links, random_profile


def _choices(prof, links):
    return unit_choices(bool(links.dha_read_GBps), True, prof.accumulation_steps > 1)


@pytest.mark.parametrize("seed", range(4))
def test_the_least_budget_is_the_least_peak_of_every_plan(seed):
    """Against every plan of three blocks: no plan peaks under the budget named, and the plan
    returned peaks exactly at it."""
    rng = random.Random(100 + seed)
    prof, links = _fix(random_profile(rng, 3)), random_links(rng)
    choices = _choices(prof, links)
    need, plan = least_memory(prof, links, choices)
    assert predict(plan, prof, links, 0.10).peak_bytes == need
    least = min(predict_options([opts[i][c] for i, c in enumerate(combo)], prof, links, rest, depth, 0.10).peak_bytes
                for depth in (1, 2) for opts in [block_options(prof, links, choices, depth)]
                for rest in ("host", "device") for combo in itertools.product(range(len(choices)), repeat=3))
    assert least == need


@pytest.mark.parametrize("seed", range(3))
def test_blocks_of_random_sizes_peak_at_the_budget_named(seed):
    """Twenty-four blocks of random sizes and costs (unbounded, seed 2's fronts grew to 80,000
    rows): the plan returned is predicted at the budget named, which min_budget names too."""
    rng = random.Random(seed)
    prof, links = _fix(random_profile(rng, 24)), random_links(rng)
    need, plan = least_memory(prof, links, _choices(prof, links))
    assert predict(plan, prof, links, 0.10).peak_bytes == need == min_budget(prof, links, _choices(prof, links))


def test_a_grouped_search_that_finds_nothing_falls_back_to_the_least_memory_plan():
    """Past GROUP_ABOVE blocks the search decides blocks in groups (here of two, the last block
    alone); at the least budget of blocks of random sizes no uniform group fits, and the search
    had raised NoPlanFitsError naming the very budget it was given. The plan of least memory
    fits it and is returned, with a note."""
    n = GROUP_ABOVE + 1
    rng = random.Random(0)
    prof, links = _fix(random_profile(rng, n)), random_links(rng)
    need = min_budget(prof, links)
    plan = schedule(prof, links, need, n)
    assert predict(plan, prof, links, 0.10).peak_bytes <= need
    assert any("plan of least device memory" in note for note in plan.notes), plan.notes
    with pytest.raises(NoPlanFitsError) as info:
        schedule(prof, links, need - 1, n, explain=False)
    assert info.value.minimum == need


def test_a_search_cut_at_its_label_cap_falls_back_to_the_least_memory_plan():
    """With three partial plans kept per block and choice, the search of twelve blocks of random
    sizes keeps none that fits the least budget; the plan of least memory does."""
    rng = random.Random(3)
    prof, links = _fix(random_profile(rng, 12)), random_links(rng)
    need = min_budget(prof, links)
    plan = schedule(prof, links, need, 12, explain=False, max_labels=3)
    assert predict(plan, prof, links, 0.10).peak_bytes <= need
    assert any("3 partial plans per block" in note for note in plan.notes), plan.notes
