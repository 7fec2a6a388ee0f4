"""The host optimizer's order: among landed gradients, the unit the next forward needs first
(``host_tasks.py``), an update under way yielding to a sooner one between pieces; the numbers are
those of any other order."""
from __future__ import annotations

import queue
import threading

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.host_tasks import TaskBoard, deadline_of
from tests.test_memferry_numerics import TinyGPT, lm_loss

# ------------------------------------------------------------------ the board alone

DEADLINE = deadline_of([True, True, True, True, False])  # blocks 0-3, then rest


def grad(index, final=True, landed=True):
    return ("grad", index, (lambda: None, final, (lambda: landed), False, 0))


def board(*tasks, deadline=DEADLINE):
    b = TaskBoard(queue.Queue(), deadline)
    b.backlog.extend(tasks)
    return b


def test_landed_updates_go_rest_first_then_by_block_index():
    tasks = [grad(3), grad(2), grad(4), grad(1)]
    b = board(*tasks)
    order = []
    while b.backlog:
        task = b.next(())
        b.remove(task)
        order.append(task[1])
    assert order == [4, 1, 2, 3]


def test_an_earlier_micro_batch_s_gradient_goes_before_any_update():
    b = board(grad(0), grad(3, final=False), grad(2, final=False))
    assert b.next(())[1] == 3  # its landing zone is what the next backward needs first


def test_nothing_behind_a_gradient_that_has_not_landed_is_taken():
    assert board(grad(3, landed=False), grad(0)).next(()) is None
    assert board(grad(3), grad(2, landed=False), grad(0)).next(()) [1] == 3


def test_a_paused_update_resumes_unless_a_landed_one_is_due_sooner():
    assert board(grad(2)).next({3}) [1] == 2
    assert board(grad(2)).next({1, 3}) == 1
    assert board(grad(2, landed=False)).next({3}) == 3
    assert board().next({3, 4}) == 4


def test_a_barrier_waits_for_updates_under_way_and_nothing_passes_it():
    lr = ("lr", 0.1, None)
    assert board(lr, grad(0)).next({3}) == 3
    assert board(lr, grad(0)).next(()) is lr
    assert board(grad(3), lr, grad(0)).next(())[1] == 3


def test_a_landed_gradient_s_event_is_asked_once_and_one_not_landed_until_it_is():
    """Each ask is a call into the device runtime; a pick used to ask every landed backlog
    task's event again. The picks are the same either way."""
    asks = {}
    state = {2: False}

    def counted(index):
        def landed():
            asks[index] = asks.get(index, 0) + 1
            return state.get(index, True)
        return ("grad", index, (lambda: None, True, landed, False, 0))

    tasks = [counted(3), counted(1), counted(2), counted(0)]
    b = board(*tasks)
    for _ in range(5):
        assert b.next(())[1] == 1  # 2 has not landed: 0 behind it waits too
    assert asks == {3: 1, 1: 1, 2: 5}
    state[2] = True
    order = []
    while b.backlog:
        task = b.next(())
        b.remove(task)
        order.append(task[1])
    assert order == [0, 1, 2, 3] and asks == {3: 1, 1: 1, 2: 6, 0: 1}


def test_host_order_is_checked():
    with pytest.raises(ValueError, match="host_order must be 'deadline' or 'landing'"):
        AdamW(host_order="lifo")


def test_without_a_deadline_tasks_go_in_arrival_order():
    assert board(grad(3), grad(0), deadline=None).next(())[1] == 3


# ------------------------------------------------------------------ the worker


def _optimizer(cpu_backend, piece=None, order="deadline"):
    torch.manual_seed(0)
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=1e-2, weight_decay=0.1, host_kernel="single-pass", host_order=order),
                      plan=Plan.uniform(4, UnitPlan("prefetch", "prefetch")), backend=cpu_backend, loss_fn=lm_loss)
    opt = engine.optimizer
    if piece is not None:
        opt.kernel.piece = piece
    gen = torch.Generator().manual_seed(1)
    for s in opt.shadows:
        s.grad_stage.copy_(torch.randn(s.grad_stage.shape, generator=gen))
    published = []
    real = opt._publish
    opt._publish = lambda index: (published.append(index), real(index))[1]
    return engine, opt, published


def _state(opt):
    return [(s.step, *(t.clone() for t in (s.master, s.exp_avg, s.exp_avg_sq, s.work))) for s in opt.shadows]


def test_the_worker_updates_in_the_next_forward_s_order_with_the_numbers_of_landing_order(cpu_backend):
    results = {}
    for order in ("deadline", "landing"):
        engine, opt, published = _optimizer(cpu_backend, order=order)
        gate = threading.Event()
        opt.submit(3, gate.wait)  # the worker blocks on the first gradient while the rest arrive
        for index in (2, 1, 0, 4):
            opt.submit(index, lambda: None, landed=lambda: True)
        gate.set()
        opt.wait_all()
        results[order] = (published, _state(opt))
        engine.close()
    # Block 3's update started first; every later pick is the unit the next forward needs first.
    assert results["deadline"][0] == [4, 0, 1, 2, 3]
    assert results["landing"][0] == [3, 2, 1, 0, 4]
    for a, b in zip(results["deadline"][1], results["landing"][1]):
        assert a[0] == b[0] == 1
        for x, y in zip(a[1:], b[1:]):
            assert torch.equal(x, y)


def test_an_update_under_way_yields_between_pieces_to_a_unit_due_sooner(cpu_backend):
    engine, opt, published = _optimizer(cpu_backend, piece=4096)
    pieces_of = opt.kernel.pieces
    landed0, gate, log, window = threading.Event(), threading.Event(), [], []

    def pieces(s, coef, *args, **kwargs):
        for times in pieces_of(s, coef, *args, **kwargs):
            log.append(s.unit.index)
            if log == [3]:
                landed0.set()  # block 0's gradient lands while block 3's update is under way
            if log == [3, 0]:
                window.append(opt.counters())  # a window opened with block 3's first piece done
            yield times

    opt.kernel.pieces = pieces
    n3 = -(-opt.shadows[3].master.numel() // 4096)
    assert n3 > 2
    opt.submit(3, gate.wait)
    opt.submit(0, landed0.wait, landed=landed0.is_set)
    gate.set()
    opt.wait_all()
    engine.close()
    n0 = len(log) - n3
    assert log == [3] + [0] * n0 + [3] * (n3 - 1)
    assert published == [0, 3]
    assert opt.updated_numel == opt.shadows[0].master.numel() + opt.shadows[3].master.numel()
    # The window counts block 3's first piece with its parameters: nothing was complete at its start.
    assert window == [(0.0, 0, 0.0)] and opt.s_per_param_since(window[0]) == opt.measured_s_per_param()


# ------------------------------------------------------------------ the cost model prices this order


def _lateness(jobs):
    """Largest ``completion + R`` of jobs (release, R, work, rank) on one worker that always runs
    the released job of the lowest rank, preempting (the worker's order, ``host_tasks.py``)."""
    t, left, worst = -float("inf"), {k: w for k, (_, _, w, _) in enumerate(jobs)}, -float("inf")
    while left:
        ready = [k for k in left if jobs[k][0] <= t]
        if not ready:
            t = min(jobs[k][0] for k in left)
            continue
        k = min(ready, key=lambda k: jobs[k][3])
        run = min([left[k], *(jobs[j][0] - t for j in left if jobs[j][0] > t)])
        t += run
        left[k] -= run
        if left[k] <= 1e-15:
            del left[k]
            worst = max(worst, t + jobs[k][1])
    return worst


def _in_landing_order(jobs):
    """Largest ``completion + R`` of jobs (release, R, work, rank) run whole one after another,
    blocks from the last down, rest last (``host_order="landing"``)."""
    t, worst = -float("inf"), -float("inf")
    for release, remaining, work, _ in sorted(jobs, key=lambda j: -j[3] if j[3] >= 0 else float("inf")):
        t = max(t, release) + work
        worst = max(worst, t + remaining)
    return worst


@pytest.mark.parametrize("order", ["deadline", "landing"])
@pytest.mark.parametrize("seed", range(40))
def test_the_model_s_host_term_is_the_worker_s_order_over_the_plan_s_landings_and_releases(seed, order):
    """Landing order: exact. Deadline order: exact where units are due in index order (then the
    worker's order is earliest deadline first); where a host-homed resident or DHA block sits
    within ``depth`` blocks below a prefetched one, the later block is due first and the model
    is an upper bound."""
    import random

    from strategies.memferry.cost import option_cost, predict_options
    from strategies.memferry.host_budget import host_budget, rest_terms
    from strategies.memferry.scheduler import unit_choices
    from tests.test_memferry_scheduler import _fix, random_links, random_profile

    rng = random.Random(seed)
    n, depth = rng.randint(1, 6), rng.choice([1, 2])
    prof, links = _fix(random_profile(rng, n)), random_links(rng)
    prof.host_order = order
    choices = unit_choices(allow_dha=links.dha_read_GBps is not None)
    rest_optimizer = rng.choice(["host", "device"])
    opts = [option_cost(prof, links, i, rng.choice(choices), depth) for i in range(n)]
    pred = predict_options(opts, prof, links, rest_optimizer, depth, 0.1)

    # The executor's timeline, block by block: forward slots, backward start of each block.
    f = [max(o.a + o.r, opts[i + 1].x if i + 1 < n else 0.0) for i, o in enumerate(opts)]
    psi = [0.0] * n
    psi[n - 1] = opts[n - 1].y
    for s in range(n - 2, -1, -1):
        psi[s] = psi[s + 1] + max(opts[s + 1].b, opts[s].y)
    pre = (prof.rest_param_bytes / (links.h2d_GBps * 1e9) if rest_optimizer == "host" else 0.0) + opts[0].x
    whole = pre + sum(f)
    jobs = []
    for j, o in enumerate(opts):
        if not o.host:
            continue
        release = j
        if o.prefetch_fwd:  # loaded at the depth-th non-DHA block below it, else at begin_forward
            below = [p for p in range(j - 1, -1, -1) if not opts[p].dha_fwd][:depth]
            release = below[-1] if len(below) == depth else None
        remaining = whole if release is None else sum(f[release:])
        jobs.append((psi[j] + o.b + o.d, remaining, o.h, j))
    if rest_optimizer == "host":
        h_rest = rest_terms(prof, host_budget(prof, links), True)[0]
        land = psi[0] + opts[0].b + opts[0].d + prof.rest_numel * prof.dtype_bytes / (links.d2h_GBps * 1e9)
        jobs.append((land, whole, h_rest, -1))
    if not jobs:
        assert "host optimizer" not in pred.parts
        return
    simulate = _lateness if order == "deadline" else _in_landing_order
    expected = pred.parts["earlier_micro_batches_s"] + pred.parts["rest_s"] + simulate(jobs)
    in_order = order == "landing" or all(a[1] >= b[1] for a, b in zip(sorted(jobs, key=lambda j: j[3]), sorted(jobs, key=lambda j: j[3])[1:]))
    if in_order:
        assert pred.parts["host optimizer"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    else:
        assert pred.parts["host optimizer"] >= expected * (1 - 1e-9)

