import math
import os
import socket
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_gmc.callbacks.metrics import AvgAtN, GreedyAccuracy, MacroAverage, PassAtK, pass_at_k


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k) in exact rational arithmetic (C(a, k) = 0 when a < k)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16, 40])
def test_pass_at_k_equals_the_combinatorial_formula(n):
    counts = torch.arange(n + 1)
    for k in range(1, n + 1):
        expected = torch.tensor([float(exact_pass_at_k(n, c, k)) for c in range(n + 1)], dtype=torch.float64)
        torch.testing.assert_close(pass_at_k(counts, n, k), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (16, 3, 4, 1 - 715 / 1820),  # C(13,4) = 715, C(16,4) = 1820
        (8, 0, 8, 0.0),
        (8, 1, 8, 1.0),
        (5, 2, 4, 1.0),  # n - c < k: every draw of 4 includes a correct one
        (10, 5, 1, 0.5),
    ],
)
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(torch.tensor([c]), n, k).item() == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow():
    # C(2000, 1000) ~ 1e600 overflows float64; the product form does not.
    value = pass_at_k(torch.tensor([1, 2, 1000]), 2000, 1000)
    assert torch.isfinite(value).all()
    torch.testing.assert_close(value[0], torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(value[1], torch.tensor(float(exact_pass_at_k(2000, 2, 1000)), dtype=torch.float64))


@pytest.mark.parametrize("seed", range(5))
def test_pass_at_k_properties_on_random_results(seed):
    generator = torch.Generator().manual_seed(seed)
    n = 16
    correct = (torch.rand(50, n, generator=generator) < torch.rand(50, 1, generator=generator)).long()  # (P, n)
    ks = list(range(1, n + 1))
    per_problem = torch.stack([pass_at_k(correct.sum(1), n, k) for k in ks])  # (n, P)
    assert ((per_problem >= 0) & (per_problem <= 1)).all()
    assert (per_problem.diff(dim=0) >= -1e-12).all()  # non-decreasing in k
    torch.testing.assert_close(per_problem[0], correct.double().mean(1))  # pass@1 = fraction correct
    torch.testing.assert_close(per_problem[-1], correct.any(1).double())  # pass@n = any correct
    metric, avg = PassAtK(n, ks), AvgAtN(n)
    metric.update(correct)
    avg.update(correct)
    values = metric.compute()
    assert values["pass@1"].item() == pytest.approx(avg.compute().item())
    assert values[f"pass@{n}"].item() == pytest.approx(correct.any(1).double().mean().item())


def test_pass_at_k_rejects_bad_input():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(torch.tensor([1]), 4, 5)
    with pytest.raises(ValueError, match="counts in"):
        pass_at_k(torch.tensor([5]), 4, 1)
    with pytest.raises(ValueError, match="ks="):
        PassAtK(8, (1, 16))


def test_metrics_accumulate_over_updates():
    correct = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1]])
    whole, parts = PassAtK(4, (1, 2, 4)), PassAtK(4, (1, 2, 4))
    whole.update(correct)
    parts.update(correct[:1])
    parts.update(correct[1:])
    assert whole.compute() == parts.compute()
    expected = {"pass@1": (0.25 + 1 + 0 + 0.5) / 4, "pass@2": (0.5 + 1 + 0 + 5 / 6) / 4, "pass@4": 3 / 4}
    assert {k: v.item() for k, v in whole.compute().items()} == pytest.approx(expected)
    avg = AvgAtN(4)
    avg.update(correct)
    assert avg.compute().item() == pytest.approx((0.25 + 1 + 0 + 0.5) / 4)
    greedy = GreedyAccuracy()
    greedy.update(torch.tensor([1, 0, 1]))
    greedy.update(torch.tensor([True]))
    assert greedy.compute().item() == pytest.approx(0.75)


def test_correctness_inputs_are_checked():
    with pytest.raises(ValueError, match=r"shape \(P, 4\), got \(2, 3\)"):
        AvgAtN(4).update(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"shape \(P,\), got \(2, 3\)"):
        GreedyAccuracy().update(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="0 or 1"):
        PassAtK(2, (1,)).update(torch.tensor([[0.5, 1.0]]))


def test_macro_average_weights_benchmarks_equally():
    macro = MacroAverage(["a", "b", "c"])
    macro.update("a", torch.tensor([1.0]))
    macro.update("b", torch.tensor([0.0, 0.0, 0.0]))
    macro.update("b", torch.tensor([1.0]))
    # a: 1.0, b: 0.25, c: never evaluated (left out) -> (1 + 0.25) / 2; the micro average would be 0.4
    assert macro.compute().item() == pytest.approx(0.625)
    with pytest.raises(ValueError, match="unknown benchmark 'd'"):
        macro.update("d", torch.tensor([1.0]))
    with pytest.raises(ValueError, match="distinct"):
        MacroAverage(["a", "a"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard_worker(rank: int, world: int, port: int, correct: torch.Tensor, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shard = correct[rank::world]
        metrics = {"pass": PassAtK(4, (1, 2, 4)), "avg": AvgAtN(4), "greedy": GreedyAccuracy(),
                   "macro": MacroAverage(["x"])}  # fmt: skip
        metrics["pass"].update(shard)
        metrics["avg"].update(shard)
        metrics["greedy"].update(shard[:, 0])
        metrics["macro"].update("x", shard.double().mean(1))
        values = {name: m.compute() for name, m in metrics.items()}
        if rank == 0:
            out.update({"pass": {k: v.item() for k, v in values["pass"].items()},
                        **{k: values[k].item() for k in ("avg", "greedy", "macro")}})  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_metrics_sync_across_processes():
    correct = (torch.rand(9, 4, generator=torch.Generator().manual_seed(0)) < 0.4).long()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_shard_worker, args=(2, _free_port(), correct, out), nprocs=2, join=True)
        synced = dict(out)
    single = PassAtK(4, (1, 2, 4))
    single.update(correct)
    assert synced["pass"] == pytest.approx({k: v.item() for k, v in single.compute().items()})
    assert synced["avg"] == pytest.approx(correct.double().mean().item())
    assert synced["greedy"] == pytest.approx(correct[:, 0].double().mean().item())
    assert synced["macro"] == pytest.approx(correct.double().mean().item())
