"""MemFerry's host-memory budget (``host_budget.py``) with synthetic host figures, and the probe's
``host`` section that feeds it (cpu backend; no figure measured here is asserted on)."""
from __future__ import annotations

import dataclasses

import pytest

from strategies.memferry.config import Plan, UnitPlan
from strategies.memferry.cost import Links, links_from_probe, option_cost, predict
from strategies.memferry.host_budget import HostBudget, MIN_SHARE, host_budget, rest_terms, update_bytes
from strategies.memferry.profiler import BlockProfile, StepProfile
from strategies.memferry.scheduler import schedule

N, REST, L = 10_000_000, 1_000_000, 4  # parameters per block, of rest; blocks


def profile(host_GBps: float, copies_slowdown: float = 1.0, copies_GBps: float = 0.0, **over) -> StepProfile:
    """4 bf16 blocks of 10 M parameters (1 ms forward, 2 ms backward, 200 MB of activations) on a
    host whose AdamW alone runs at ``host_GBps`` (28 B per parameter) and ``copies_slowdown``
    times slower beside copies moving ``copies_GBps``."""
    rate = 28 / (host_GBps * 1e9)
    blocks = [BlockProfile(N, 2 * N, 1e-3, 2e-3, 200_000_000, 2_000_000) for _ in range(L)]
    prof = StepProfile(blocks, REST, 2 * REST, 0.2e-3, 0.4e-3, 10_000_000, 1000, 2, 4096, rate, 1e-11,
                       host_adamw_copies_s_per_param=rate * copies_slowdown if copies_GBps else 0.0,
                       host_copies_GBps=copies_GBps, host_adamw_bytes_per_param=28)
    return dataclasses.replace(prof, **over)


def links(host_GBps: float | None = None) -> Links:
    return Links(50.0, 50.0, None, host_GBps=host_GBps)


def test_update_bytes_count_what_the_host_optimizer_moves():
    # bf16: gradient 2 + master and moments 24 + working copy 2; fp32: the master is the copy
    assert update_bytes(2).timed == update_bytes(4).timed == 28 and update_bytes(2).final == 28
    four = update_bytes(2, 4, "speculative")
    assert four.kernel == 30  # the pass reads the fp32 sum
    assert (four.accumulate_earlier, four.accumulate_final) == (6 + 2 * 10, 10)  # copy 2+4, then 2+4+4 each
    assert (four.backup, four.norm) == (0, 4)  # bf16: updated into its spare; the norm reads the fp32 sum
    assert four.timed == 10 * 4 + 26 and four.final == 30 + 10 + 4
    assert update_bytes(4, 1, "speculative").backup == 12  # fp32: backed up in the update's sweep
    assert update_bytes(2, 1, "wait").backup == 0 and update_bytes(2, 1, "wait").norm == 2
    # summed on the device: the host only reads the fp32 sum in its pass
    dev = update_bytes(2, 4, "speculative", device_sum=True)
    assert (dev.kernel, dev.accumulate_earlier, dev.accumulate_final, dev.timed) == (30, 0, 0, 30)
    # summed two at a time: the first pair 2+2+4, each later one 4+2+2+4, an odd last 2+4+4
    # (with clipping, which reads the step's sum: the last pair is summed too)
    pairs = {n: update_bytes(2, n, "wait", paired=True) for n in (2, 3, 4)}
    assert [(pairs[n].accumulate_earlier, pairs[n].accumulate_final, pairs[n].kernel) for n in (2, 3, 4)] == [
        (0, 8, 30), (8, 10, 30), (8, 12, 30)]
    # without clipping nothing is summed after the last micro-batch: the update adds a last pair as
    # it reads it (2 + 2, and the sum before it, 4), and of an odd count the last micro-batch
    # beside the fp32 sum (4 + 2)
    assert [(update_bytes(2, n, paired=True).accumulate_final, update_bytes(2, n, paired=True).kernel,
             update_bytes(2, n, paired=True).accumulate_earlier) for n in (2, 3, 4, 5)] == [
        (0, 24 + 4 + 2, 0), (0, 24 + 6 + 2, 8), (0, 24 + 8 + 2, 8), (0, 24 + 6 + 2, 8 + 12)]
    eight = update_bytes(2, 8, "wait", paired=True)
    assert eight.accumulate_earlier + eight.accumulate_final == 44  # against 76 one by one
    # pairs (1, 2), (3, 4), (5, 6), then the update adds (7, 8): 8 B fewer than summing them first
    assert (update_bytes(2, 8, paired=True).kernel, update_bytes(2, 8, paired=True).timed) == (34, 32 + 34)
    assert update_bytes(2, 8, device_sum=True, paired=True).timed == 30  # nothing summed on the host
    # split in two passes: the working copy and the fp32 gradient once the last pair has landed
    # (26 B, not 34), the master and moments later (28 B, with the earlier micro-batches)
    split = update_bytes(2, 8, paired=True, split=True)
    assert (split.kernel, split.final, split.deferred, split.timed) == (26, 26, 28, 32 + 26 + 28)
    assert update_bytes(2, 8, device_sum=True, paired=True, split=True).kernel == 30 - 12 + 4
    clipped = update_bytes(2, 8, "speculative", paired=True, split=True)  # the fp32 sum read, the pair not fused
    assert (clipped.kernel, clipped.deferred, clipped.backup) == (30 - 12 + 4, 28, 0)
    assert update_bytes(4, 8, paired=True, split=True).deferred == 0  # an fp32 master is the copy
    assert update_bytes(2, 1, split=True).deferred == 0  # no accumulation: nothing to wait for
    # the sum that starts in the last earlier micro-batch (one micro-batch's compute to finish in):
    # an odd count's last pair (the first pair of 3: 4 + 2g; later ones 8 + 2g), with or without
    # clipping; none where the last earlier micro-batch waits for the last (an even count's pair)
    tail = {(n, clip): update_bytes(2, n, clip, paired=True).accumulate_tail
            for n in (2, 3, 4, 5, 8) for clip in ("", "wait")}
    assert tail == {(2, ""): 0, (3, ""): 8, (4, ""): 0, (5, ""): 12, (8, ""): 0,
                    (2, "wait"): 0, (3, "wait"): 8, (4, "wait"): 0, (5, "wait"): 12, (8, "wait"): 0}
    # one by one, the one before the last (copied 4 + g where it is the first, else added 8 + g)
    assert [update_bytes(2, n).accumulate_tail for n in (2, 4)] == [6, 10]
    assert update_bytes(2, 5, device_sum=True, paired=True).accumulate_tail == 0


def test_a_split_updates_second_pass_is_priced_with_the_earlier_micro_batches():
    budget = HostBudget(100.0, kernel_weight=1.5, copy_weight=0.0, source="test", update_scale=2.0, earlier_scale=0.5)
    one, split = update_bytes(2, 8, paired=True), update_bytes(2, 8, paired=True, split=True)
    final, earlier = budget.work(1000, one)
    assert (final, earlier) == (1000 * 1.5 * 34 * 2.0, 1000 * 32 * 0.5)
    final, earlier = budget.work(1000, split)
    assert (final, earlier) == (1000 * 1.5 * 26 * 2.0, 1000 * (32 + 1.5 * 28) * 0.5)


def test_a_host_bound_step_takes_its_host_bytes_over_the_bandwidth_and_copies_slow_the_optimizer():
    """Every block host-updated, prefetched and its activations offloaded: the optimizer's bytes and
    the link bytes weighted by kappa, over B, exceed the compute chain (and the host worker's
    chain), and the prediction is exactly that; the same plan with copies that cost the host
    nothing predicts a faster optimizer."""
    B = 2.0  # GB/s: scarce
    plan = Plan.from_spec("prefetch+offload", L)  # rest host-homed too
    # The kernel alone at 14 ns/param, twice that beside copies moving 1 GB/s: kappa = B (1 - 1/2) / 1
    busy = profile(B, copies_slowdown=2.0, copies_GBps=1.0)
    kappa = 1.0
    assert host_budget(busy, links(B)).copy_weight == pytest.approx(kappa)
    w = g = 2 * N  # weights and gradients of a block, bytes
    act = busy.blocks[0].act_bytes
    fwd, bwd = w + act, w + g + act  # per block: weights in, activations out; weights in, gradients out, activations in
    link = L * fwd + L * bwd - w  # the last block keeps its forward copy for backward
    link += 2 * REST + 2 * REST  # rest reloaded before the forward, its gradients home
    optimizer = 28 * (L * N + REST)
    pred = predict(plan, busy, links(B))
    assert pred.bound == "host memory"
    assert pred.step_s == pytest.approx((optimizer + kappa * link) / (B * 1e9), rel=1e-9)
    assert pred.compute_s < pred.step_s  # the bytes exceed bandwidth x compute time
    free = predict(plan, profile(B), links(B))  # copies not measured: they cost the host nothing
    assert free.parts["host memory"] == pytest.approx(optimizer / (B * 1e9), rel=1e-9)
    assert free.step_s < pred.step_s and free.host_optimizer_s < pred.host_optimizer_s
    # A block's update runs beside its own backward's copies, at the rate left beside them while
    # they last (here they end first: the update then pays for all of them once).
    o = option_cost(busy, links(B), 1, plan.units[1])
    slot, bw = max(o.b, o.y, o.d), B * 1e9
    shared = max(bw - kappa * bwd / slot, MIN_SHARE * bw)  # here the copies alone would take all of B
    assert o.h == pytest.approx(min(28 * N / shared, (28 * N + kappa * bwd) / bw), rel=1e-9)
    assert o.h == pytest.approx((28 * N + kappa * bwd) / bw, rel=1e-9)
    assert o.h > option_cost(profile(B), links(B), 1, plan.units[1]).h


def test_accumulation_and_speculative_clipping_are_host_bytes_and_micro_batches_are_compute():
    B = 2.0
    plan = Plan.from_spec("prefetch", L)
    one = predict(plan, profile(B), links(B))
    four = predict(plan, profile(B, accumulation_steps=4, clipping=True), links(B))  # clip_mode speculative
    extra = update_bytes(2, 4, "speculative", paired=True)  # the host sums micro-batches two at a time
    # kappa 0: only the optimizer's own bytes, which grow from 28 to the accumulated, backed-up update's
    assert four.parts["host memory"] == pytest.approx(
        (L * N + REST) * (extra.timed + extra.norm) / (B * 1e9), rel=1e-9)
    # three more micro-batches of forward and backward, without rest's reload
    pre = 2 * REST / 50e9
    assert four.compute_s == pytest.approx(one.compute_s + 3 * (one.compute_s - pre), rel=1e-9)
    # Blocks summing on the device: per parameter the host reads one fp32 sum (30 B in its pass,
    # not the 50 of summing 4 in pairs) and 4 link bytes come home once instead of 2 per
    # micro-batch (kappa 1 here).
    busy = profile(B, copies_slowdown=2.0, copies_GBps=1.0, accumulation_steps=4)
    summed = Plan([dataclasses.replace(u, accumulate="device") for u in plan.units])
    on_host, on_device = predict(plan, busy, links(B)), predict(summed, busy, links(B))
    saved = L * N * ((update_bytes(2, 4, paired=True).timed - 30) + 1.0 * (4 * 2 - 4))
    assert on_host.parts["host memory"] - on_device.parts["host memory"] == pytest.approx(saved / (B * 1e9), rel=1e-9)
    o_host, o_dev = (option_cost(busy, links(B), 1, p.units[1]) for p in (plan, summed))
    assert o_dev.d == pytest.approx(2 * o_host.d) and o_dev.persist - o_host.persist == 4 * N and o_dev.h_acc == 0


def test_clipping_reads_a_gradient_for_its_norm_only_where_the_device_cannot_sum_its_squares():
    """One micro-batch: a prefetched block's norm is the device's (no host byte more with
    clipping), a DHA block's is the host's (2 B per parameter); summed on the host over four
    micro-batches, it reads the 4 B fp32 sum."""
    B = 2.0
    plain, clipped = profile(B), profile(B, clipping=True)
    assert update_bytes(2, 1, "speculative", host_norm=False).norm == 0
    assert update_bytes(2, 1, "speculative").norm == 2 and update_bytes(2, 4, "wait").norm == 4
    pre = Plan.from_spec("prefetch", L)
    assert predict(pre, clipped, links(B)).parts["host memory"] == pytest.approx(
        predict(pre, plain, links(B)).parts["host memory"], rel=1e-12)
    dha = UnitPlan("dha", "dha")
    extra = option_cost(clipped, links(B), 1, dha).hm - option_cost(plain, links(B), 1, dha).hm
    assert extra == pytest.approx(N * 2 / (B * 1e9), rel=1e-9)
    four, four_clipped = profile(B, accumulation_steps=4), profile(B, accumulation_steps=4, clipping=True)
    unit = UnitPlan("prefetch", "prefetch")
    extra = option_cost(four_clipped, links(B), 1, unit).hm - option_cost(four, links(B), 1, unit).hm
    # the norm reads the 4 B sum, which clipping needs whole: the last pair is summed first (8 B more)
    assert extra == pytest.approx(N * (4 + 8) / (B * 1e9), rel=1e-9)


def test_the_scheduler_moves_updates_to_the_device_when_host_memory_shrinks():
    budget = 1.0e9
    plans = {}
    for B in (1000.0, 2.0):  # a fast host, then one 500x slower (its AdamW too)
        prof = profile(B, copies_slowdown=1.5, copies_GBps=B / 4)
        plans[B] = schedule(prof, links(B), budget, L, allow_dha=False, depths=(1,), explain=False, max_labels=None)
    on_device = {B: sum(u.optimizer == "device" for u in p.units) for B, p in plans.items()}
    assert on_device[1000.0] == 0 and on_device[2.0] > 0, on_device
    # the fast host's plan is no good on the slow one: the slow host's own plan beats it there
    slow = profile(2.0, copies_slowdown=1.5, copies_GBps=0.5)
    assert plans[2.0].predicted_step_s < predict(plans[1000.0], slow, links(2.0)).step_s


def test_the_probe_s_host_section_is_cached_and_read_into_links(cpu_backend, tmp_path, monkeypatch):
    from xpu.host_bandwidth import measure_host
    from xpu.probe import ProbeConfig, cache_path, load_cached, run_probe, save_cached

    monkeypatch.setenv("XPU_CACHE_DIR", str(tmp_path))
    cfg = ProbeConfig.for_backend(cpu_backend, quick=True)
    assert cfg.host_nbytes == 8 * 2**20  # quick: small buffers
    small = dataclasses.replace(cfg, nbytes=2**20, matmul_dim=64, matmul_ms=[16])
    result = run_probe(cpu_backend, dataclasses.replace(small, host_nbytes=2**20))
    host = result["host"]
    assert set(host) == {"threads", "array_bytes", "copy_GBps", "triad_GBps", "adamw_ns_per_param",
                         "triad_with_copies_GBps", "adamw_with_copies_ns_per_param", "copies_GBps",
                         "transparent_hugepages"}
    from xpu.hostmem import transparent_huge_pages

    assert host.pop("transparent_hugepages") == transparent_huge_pages()
    assert host["array_bytes"] == 2**20 and all(v > 0 for v in host.values())
    save_cached(cpu_backend, result)
    assert cache_path(cpu_backend).parent == tmp_path and load_cached(cpu_backend)["host"] == host
    got = links_from_probe(cpu_backend, 0)
    assert got.host_GBps == host["triad_GBps"]
    assert got.host_copy_weight == pytest.approx(
        max(0.0, (host["triad_GBps"] - host["triad_with_copies_GBps"]) / host["copies_GBps"]))
    # no host section (a probe from before it, or --host-size 0): no host figures
    assert links_from_probe(cpu_backend, 0, {"h2d_pinned_GBps": 9.0}).host_GBps is None
    assert "host" not in run_probe(cpu_backend, dataclasses.replace(small, host_nbytes=0))
    with pytest.raises(ValueError, match="nbytes >= 4"):
        measure_host(cpu_backend, 0)


def test_sums_that_overrun_the_last_earlier_micro_batch_delay_the_updates():
    """Accumulation 3 sums its first pair while the second micro-batch's backward and the third's
    forward run: on a slow host that overruns them, and the updates of the last micro-batch
    start that much later (``earlier_spill_s``); an even count's last earlier pair has two
    micro-batches, and a fast host's pair fits in one."""
    plan = Plan.from_spec("prefetch", L)

    def spill(B: float, n: int) -> tuple[float, float]:
        prof = profile(B, accumulation_steps=n)
        pred = predict(plan, prof, links(B))
        tails = sum(option_cost(prof, links(B), i, u).h_tail for i, u in enumerate(plan.units))
        tails += rest_terms(prof, host_budget(prof, links(B)), plan.rest_optimizer == "host").tail
        one = pred.parts["earlier_micro_batches_s"] / (n - 1)
        return pred.parts["earlier_spill_s"], tails - one

    slow, expected = spill(2.0, 3)
    assert expected > 0 and slow == pytest.approx(expected, rel=1e-12)
    assert spill(2.0, 4)[0] == 0.0  # the pair (1, 2) has the 3rd micro-batch too; (3, 4) goes to the update
    assert spill(2000.0, 3)[0] == 0.0
    prof = profile(2.0, accumulation_steps=3)
    pred = predict(plan, prof, links(2.0))
    assert pred.step_s >= pred.parts["host optimizer"] > slow
    # the plan's notes say it, where the search's plan has such sums (a budget that keeps blocks home)
    searched = schedule(prof, links(2.0), 0.31e9)
    said = next(n for n in searched.notes if n.startswith("predicted:"))
    assert "the sums starting in the last earlier micro-batch overrun it by" in said
