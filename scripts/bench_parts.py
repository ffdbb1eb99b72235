"""Micro-benchmark of the per-update parts changed in the third to eighth rounds of issue 14, against what
they replaced.

Each pair runs in alternating blocks of calls (process CPU time, one torch thread; medians over blocks), and the
script checks that both sides give the same results before timing them:

- ``Diagnostics``' per-update scalars: :func:`step_scalars` (Python floats) against the same scalars as float64
  torch reductions one by one (the former implementation, restated here); they agree within 4 float64 ulps (the
  standard deviation and the correlations differ in the last bits: ``math.fsum`` against torch's order of
  addition), and the script counts the values that differ in float64 and after rounding to float32;
- :func:`seed_sampling` against ``torch.manual_seed`` (which also seeds every backend this build has);
- ``RunningDelayMoments.update`` (Python floats) against its former three float64 torch reductions (restated
  here): the same bits on every draw;
- one logger event of 25 scalars built in place (``WriteThroughSummaryWriter.add_scalar_dict``) against the
  values built apart then wrapped in a ``Summary`` and an ``Event`` (``FileWriter.add_summary``, its former
  body): the same event;
- the TFRecord checksum of a ~9 kB event (a histogram's) by ``fast_masked_crc32c`` (``google-crc32c``) against
  TensorBoard's byte loop: the same value.

Fifth round:

- ``HFEngine``'s and ``collate_groups``' left-padded prompts and mask (:func:`left_padded`: one ``pad_sequence``,
  the mask from the lengths) against what each did before (restated here): one slice write per row of the ids and
  of the mask in ``HFEngine``, per-group writes and an ``arange`` comparison in ``collate_groups``; the same
  tensors;
- ``Diagnostics``' zero-variance fraction on the rewards' values (:func:`tied_fraction`) against
  ``zero_variance_fraction`` on the tensor: the same float on every draw;
- Lightning's profiler context per hook: lit_gmc's :class:`NoProfiler` against the stock ``PassThroughProfiler``.

Sixth round:

- a launch's 8 prompts encoded by :func:`encode_prompts` (one backend call per prompt) against the tokenizer's
  batched call, and its 64 responses decoded by :func:`decode_responses` against ``batch_decode``: the same ids
  and texts. (The third round's pair, one tokenizer call against one per prompt, is replaced by the first.)
- :func:`left_padded` written into numpy arrays against the fifth round's ``pad_sequence`` (restated here), in
  ``HFEngine`` (with the per-prompt tensors: through numpy now, ``torch.tensor`` before) and in
  ``collate_groups``: the same tensors. (These replace the fifth round's two padding pairs.)

Seventh round:

- ``HFEngine``'s behaviour log-probs of a launch (64 rows, 6 positions, the tiny vocabulary) by
  :func:`sampled_logprobs` (the positions in one chunk) against one log-softmax and gather per position (the sixth
  round's loop, restated here): the same tensor;
- a launch's 8 scored groups by ``RolloutGroup.with_rewards`` (rewards through numpy) against the sixth round's
  ``torch.as_tensor`` (restated here): the same groups;
- Lightning's hook name set on the learner 30 times (an update's worth): ``GMCModule``'s ``__setattr__`` against
  ``nn.Module``'s;
- ``Diagnostics``' two correlations with the response length under a fixed delay (:func:`correlations`: y's side
  once, the constant delay skipped) against the sixth round's (restated here): the same values.

Eighth round:

- the next batch from the training loader: :class:`RolloutStream` (a plain iterable) against the seventh round's
  ``DataLoader`` over an ``IterableDataset`` (restated here), both over a stand-in DataModule that hands out one
  prepared batch: the same object;
- the learner's two finiteness checks (loss and gradient norm, 0-dim tensors): ``math.isfinite`` of their floats
  against ``torch.isfinite``: the same verdicts, on finite, infinite and NaN values.

    python scripts/bench_parts.py [--blocks 40] [--block 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import struct
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from lightning.pytorch.profilers import PassThroughProfiler
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, IterableDataset

from lit_gmc import objectives as O
from lit_gmc.actor import load_actor
from lit_gmc.batch import RolloutGroup, left_padded, small_tensor
from lit_gmc.callbacks.diagnostics import as_values, correlations, exact_mean, step_scalars, tied_fraction
from lit_gmc.cli import NoProfiler
from lit_gmc.data.datamodule import RolloutStream
from lit_gmc.data.engines import sampled_logprobs, seed_sampling
from lit_gmc.data.tasks import Addition, PromptStream
from lit_gmc.data.tokens import decode_responses, encode_prompts
from lit_gmc.delays import RunningDelayMoments
from lit_gmc.loggers import WriteThroughSummaryWriter, fast_masked_crc32c
from lit_gmc.module import GMCModule

B, G = 8, 8  # configs/tiny.yaml


def torch_step_scalars(stats: dict[str, torch.Tensor], cap_eps: float = 0.28) -> dict[str, float]:
    """The scalars of :func:`step_scalars` as float64 torch reductions, one call each."""
    lr, lb = stats["log_rho"].double(), stats["log_rho_bar"].double()
    mass, ess, lengths = stats["removed_mass"].double(), stats["ess"].double(), stats["response_lengths"].double()
    median, q90 = lb.quantile(lb.new_tensor([0.5, 0.9]))
    cap = math.log1p(cap_eps)
    out = {
        "log_rho/mean": lr.mean(), "log_rho/std": lr.std(unbiased=False), "log_rho/min": lr.min(),
        "log_rho/max": lr.max(), "log_rho/abs_mean": lr.abs().mean(), "rho_bar/log_mean": lb.mean(),
        "rho_bar/log_median": median, "rho_bar/log_q90": q90, "rho_bar/log_max": lb.max(),
        "gmc/rescaled_fraction": (lb > cap).double().mean(), "tic/dropped_fraction": (lr > cap).double().mean(),
        "removed_mass/mean": mass.mean(), "removed_mass/max": mass.max(), "ess/mean": ess.mean(),
        "ess/min": ess.min(), "ess/mean_fraction_of_G": ess.mean() / G, "response_length/mean": lengths.mean(),
        "response_length/max": lengths.max(), "entropy/mean": stats["entropy"].double().mean(),
        "reward/zero_variance_fraction": O.zero_variance_fraction(stats["rewards"], G),
        "drain/active": stats["schedule/draining"],
    }  # fmt: skip
    for key, tag in (("log_rho", "corr/log_rho_vs_length"), ("delays", "corr/delay_vs_length")):
        x = stats[key].double()
        dx, dy = x - x.mean(), lengths - lengths.mean()
        denominator = math.sqrt(float((dx * dx).sum() * (dy * dy).sum()))
        if denominator > 0:
            out[tag] = float((dx * dy).sum()) / denominator
    return {key: float(value) for key, value in out.items()}


def torch_delay_moments(delays: torch.Tensor) -> tuple[float, float, float]:
    """The update's mean delay, squared delay and fourth-power delay as ``RunningDelayMoments`` took them before."""
    d = delays.detach().double().flatten()
    return float(d.mean()), float((d**2).mean()), float((d**4).mean())


def python_delay_moments(delays: torch.Tensor) -> tuple[float, float, float]:
    """The same three means through ``RunningDelayMoments.update`` (now on Python floats)."""
    moments = RunningDelayMoments()
    moments.update(delays)
    return moments.tau1, moments.tau2, moments.tau4


def padded_by_pad_sequence(sequences: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`left_padded` as the fifth round wrote it: one ``pad_sequence``, the mask built from nested lists."""
    padded = pad_sequence(list(sequences), batch_first=True, padding_value=pad_id, padding_side="left")
    width = padded.shape[1]
    mask = torch.tensor([[False] * (width - len(s)) + [True] * len(s) for s in sequences], dtype=torch.bool)
    return padded, mask


def engine_prompts_before(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """``HFEngine``'s prompt tensors in the fifth round: one tensor per prompt, then padded (ids, long mask, rows)."""
    prompt_ids = [torch.tensor(ids, dtype=torch.long) for ids in token_lists]
    input_ids, mask = padded_by_pad_sequence(prompt_ids, pad_id)
    return input_ids, mask.long(), *prompt_ids


def engine_prompts(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """The same as ``HFEngine`` builds them now: :func:`left_padded` on the lists, each prompt through numpy."""
    input_ids, mask = left_padded(token_lists, pad_id)
    return input_ids, mask.long(), *(small_tensor(ids, np.int64) for ids in token_lists)


def logprobs_by_position(scores: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """``HFEngine``'s behaviour log-probs in the sixth round: one log-softmax and gather per position, stacked."""
    return torch.stack(
        [torch.log_softmax(s.float(), -1).gather(-1, tokens[:, t, None])[:, 0] for t, s in enumerate(scores)], 1
    )


def with_rewards_before(group: RolloutGroup, rewards: list[float], **changes) -> RolloutGroup:
    """``RolloutGroup.with_rewards`` in the sixth round: ``torch.as_tensor`` of the list."""
    return dataclasses.replace(group, rewards=torch.as_tensor(rewards, dtype=torch.float32), **changes)


def correlations_before(xs: list[torch.Tensor], y: torch.Tensor) -> list[float | None]:
    """``Diagnostics``' correlations in the sixth round: y's deviations again for each x, a constant x included."""
    y_values = as_values(y)
    y_finite = all(map(math.isfinite, y_values))
    out: list[float | None] = []
    for x in xs:
        xk, yk = as_values(x), y_values
        if not (y_finite and all(map(math.isfinite, xk))):
            kept = [(a, b) for a, b in zip(xk, yk, strict=True) if math.isfinite(a) and math.isfinite(b)]
            xk, yk = [a for a, _ in kept], [b for _, b in kept]
        if len(xk) < 2:
            out.append(None)
            continue
        x_mean, y_mean = exact_mean(xk), exact_mean(yk)
        dx, dy = [a - x_mean for a in xk], [b - y_mean for b in yk]
        sxx, syy = math.fsum([a * a for a in dx]), math.fsum([b * b for b in dy])
        sxy = math.fsum([a * b for a, b in zip(dx, dy, strict=True)])
        denominator = math.sqrt(sxx * syy)
        out.append(sxy / denominator if denominator > 0 else None)
    return out


class FixedShares:
    """A stand-in DataModule for the loaders: the same prepared batch at every update, for ever."""

    def __init__(self, batch: object) -> None:
        self.batch = batch

    def next_share(self) -> object:
        return self.batch


class StreamBefore(IterableDataset):
    """The seventh round's training stream, read through a ``DataLoader`` (restated)."""

    def __init__(self, datamodule: FixedShares) -> None:
        self.dm = datamodule

    def __iter__(self):
        while (share := self.dm.next_share()) is not None:
            yield share


def finite_floats(loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """The learner's two finiteness checks as now: on the values as Python floats."""
    return math.isfinite(float(loss)) and math.isfinite(float(grad_norm))


def finite_tensors(loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """The same checks as before: ``torch.isfinite`` of each 0-dim tensor."""
    return bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))


def launch_groups(seed: int) -> list[RolloutGroup]:
    """A launch of the tiny job's shape: 8 groups of 8 responses of 6 tokens, rewards still unset."""
    gen = torch.Generator().manual_seed(seed)
    return [
        RolloutGroup(prompt_id=b, prompt="1+2=", answer="3", prompt_ids=torch.tensor([5, 6, 7, 8]),
                     response_ids=torch.randint(3, 30, (G, 6), generator=gen),
                     response_mask=torch.ones(G, 6, dtype=torch.bool),
                     behavior_logprobs=-torch.rand(G, 6, generator=gen), finish_reasons=["length"] * G,
                     rewards=torch.zeros(G), version=0)
        for b in range(B)
    ]  # fmt: skip


def tiny_stats(seed: int) -> dict[str, torch.Tensor]:
    """Stats of the tiny job's shape: 64 rows in 8 groups, ~200 response tokens."""
    gen = torch.Generator().manual_seed(seed)
    log_rho = torch.randn(B * G, generator=gen) * 0.1
    return {
        "log_rho": log_rho, "rewards": (torch.rand(B * G, generator=gen) > 0.5).float(),
        "response_lengths": torch.randint(1, 7, (B * G,), generator=gen),
        "delays": torch.randint(0, 3, (B * G,), generator=gen), "log_rho_bar": O.group_log_mean_ratio(log_rho, G),
        "removed_mass": torch.rand(B, generator=gen), "ess": torch.rand(B, generator=gen) * G,
        "entropy": torch.rand(200, generator=gen), "schedule/draining": torch.tensor(0.0),
    }  # fmt: skip


def timed(pairs: dict[str, Callable[[], object]], blocks: int, block: int) -> dict[str, float]:
    """Median process CPU microseconds per call of each function, blocks of calls alternated."""
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(blocks):
        for name, fn in pairs.items():
            start = time.process_time()
            for _ in range(block):
                fn()
            times[name].append((time.process_time() - start) / block)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--block", type=int, default=50, help="calls per block")
    args = parser.parse_args()
    torch.set_num_threads(1)

    stats = tiny_stats(0)
    values = differ = differ32 = 0
    for seed in range(300):  # same values on many draws, up to a few float64 ulps (fsum against torch's order)
        ours, theirs = step_scalars(tiny_stats(seed)), torch_step_scalars(tiny_stats(seed))
        for key, value in theirs.items():
            if abs(ours[key] - value) > 4 * math.ulp(value):
                raise SystemExit(f"step_scalars differs from the torch reductions in {key} on seed {seed}")
            values, differ = values + 1, differ + (ours[key] != value)
            differ32 += struct.pack("<f", ours[key]) != struct.pack("<f", value)  # what TensorBoard stores
    print(f"step_scalars against torch reductions: {differ} of {values} values differ in float64 (<= 4 ulps), "
          f"{differ32} once rounded to float32")
    _, tok = load_actor("tiny")
    texts = [p.text for p in PromptStream(Addition().train_prompts(), seed=0).take(B)]
    one_call = lambda: tok(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    if encode_prompts(tok, texts) != one_call():
        raise SystemExit("encode_prompts gives other ids than the tokenizer's call")
    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(0, len(tok), (B * G, 6), generator=gen).tolist()  # any ids: EOS and padding too
    if decode_responses(tok, responses) != tok.batch_decode(responses, skip_special_tokens=True):
        raise SystemExit("decode_responses gives other texts than the tokenizer's batch_decode")
    cpu = torch.device("cpu")
    seed_sampling(cpu, 7)
    ours = torch.rand(4)
    torch.manual_seed(7)
    if not torch.equal(ours, torch.rand(4)):
        raise SystemExit("seed_sampling and torch.manual_seed give other draws")

    for seed in range(300):  # delays of fixed-delay and live runs: the same bits
        gen = torch.Generator().manual_seed(seed)
        delays = torch.randint(0, [1, 9, 33, 129, 1001][seed % 5], (B * G,), generator=gen)
        if python_delay_moments(delays) != torch_delay_moments(delays):
            raise SystemExit(f"RunningDelayMoments differs from the torch reductions on seed {seed}")
    delays = torch.full((B * G,), 8)
    writer = WriteThroughSummaryWriter(tempfile.mkdtemp())
    scalars = {f"diag/scalar_{k}": random.Random(k).random() for k in range(25)}
    in_place = lambda: writer.add_scalar_dict(scalars, 3)  # noqa: E731
    file_writer = writer._get_file_writer()
    apart = lambda: file_writer.add_summary(  # noqa: E731
        Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]), 3
    )
    events, write = [], file_writer.event_writer.add_event
    file_writer.event_writer.add_event = events.append  # keep both events instead of writing them
    in_place()
    apart()
    file_writer.event_writer.add_event = write
    events[0].wall_time = events[1].wall_time
    if events[0] != events[1]:
        raise SystemExit("the event built in place differs from the one built apart")
    record = random.Random(0).randbytes(9000)
    if fast_masked_crc32c(record) != masked_crc32c(record):
        raise SystemExit("fast_masked_crc32c differs from TensorBoard's masked_crc32c")

    token_lists = one_call()
    prompt_ids = [torch.tensor(ids) for ids in token_lists]
    for now, before in [(engine_prompts(token_lists, 0), engine_prompts_before(token_lists, 0)),
                        (left_padded(prompt_ids, 0), padded_by_pad_sequence(prompt_ids, 0))]:  # fmt: skip
        if not all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(now, before, strict=True)):
            raise SystemExit("left_padded differs from the fifth round's padding")
    for seed in range(300):  # ties, NaN and float32 rounding of the share
        gen = torch.Generator().manual_seed(seed)
        rewards = torch.randint(0, 2 + seed % 3, (B * G,), generator=gen).float()
        rewards[seed % (B * G)] = math.nan if seed % 7 == 0 else rewards[seed % (B * G)]
        if tied_fraction(rewards.tolist(), G) != O.zero_variance_fraction(rewards, G):
            raise SystemExit(f"tied_fraction differs from zero_variance_fraction on seed {seed}")
    stock, quiet = PassThroughProfiler(), NoProfiler()

    gen = torch.Generator().manual_seed(0)
    scores = [torch.randn(B * G, len(tok), generator=gen) for _ in range(6)]  # a launch: 64 rows, 6 positions
    sampled = torch.randint(0, len(tok), (B * G, 6), generator=gen)
    if not torch.equal(sampled_logprobs(scores, sampled), logprobs_by_position(scores, sampled)):
        raise SystemExit("sampled_logprobs differs from the per-position loop")
    groups, rewards = launch_groups(0), [[float((b + i) % 2) for i in range(G)] for b in range(B)]

    def score_now() -> list[RolloutGroup]:
        return [g.with_rewards(r, batch_id=3) for g, r in zip(groups, rewards, strict=True)]

    def score_before() -> list[RolloutGroup]:
        return [with_rewards_before(g, r, batch_id=3) for g, r in zip(groups, rewards, strict=True)]

    for now, before in zip(score_now(), score_before(), strict=True):
        if not (torch.equal(now.rewards, before.rewards) and now.rewards.dtype == before.rewards.dtype
                and now.batch_id == before.batch_id):  # fmt: skip
            raise SystemExit("with_rewards differs from torch.as_tensor's rewards")
    learner = GMCModule(actor="tiny")

    def set_ours() -> None:
        for _ in range(30):
            learner._current_fx_name = "on_train_batch_end"

    def set_module() -> None:
        for _ in range(30):
            torch.nn.Module.__setattr__(learner, "_current_fx_name", "on_train_batch_end")

    for seed in range(300):  # a constant delay (fixed-delay schedule) on even seeds, varied delays on odd ones
        drawn = tiny_stats(seed)
        delays_x = drawn["delays"] if seed % 2 else torch.full((B * G,), 8)
        xs, y = [drawn["log_rho"], delays_x], drawn["response_lengths"]
        if correlations(xs, y) != correlations_before(xs, y):
            raise SystemExit(f"correlations differ from the sixth round's on seed {seed}")
    xs_fixed = [stats["log_rho"], torch.full((B * G,), 8)]  # the default schedule delays every row by 8

    shares = FixedShares(launch_groups(1))
    stream_now = iter(RolloutStream(shares))
    loader_before = iter(DataLoader(StreamBefore(shares), batch_size=None, num_workers=0, collate_fn=lambda b: b))
    if not (next(stream_now) is next(loader_before) is shares.batch):
        raise SystemExit("RolloutStream and the DataLoader hand out different batches")
    checked = [torch.tensor(v) for v in (0.5, -3.0, math.inf, -math.inf, math.nan)]
    if any(finite_floats(a, b) != finite_tensors(a, b) for a in checked for b in checked):
        raise SystemExit("the finiteness checks on floats and on tensors disagree")
    loss, grad_norm = checked[0], checked[1]

    def hook_in(profiler) -> None:
        with profiler.profile("[Callback]Diagnostics.on_train_batch_end"):
            pass

    rows = [
        ("Diagnostics' scalars", timed({"step_scalars": lambda: step_scalars(stats),
                                         "torch reductions": lambda: torch_step_scalars(stats)},
                                        args.blocks, args.block)),
        ("encode 8 prompts", timed({"encode_prompts": lambda: encode_prompts(tok, texts), "tokenizer call": one_call},
                                    args.blocks, args.block)),
        ("decode 64 responses", timed({"decode_responses": lambda: decode_responses(tok, responses),
                                       "batch_decode": lambda: tok.batch_decode(responses, skip_special_tokens=True)},
                                      args.blocks, args.block)),
        ("seed a launch", timed({"seed_sampling": lambda: seed_sampling(cpu, 7),
                                 "torch.manual_seed": lambda: torch.manual_seed(7)}, args.blocks, args.block)),
        ("delay moments", timed({"Python floats": lambda: python_delay_moments(delays),
                                 "torch reductions": lambda: torch_delay_moments(delays)}, args.blocks, args.block)),
        ("event of 25 scalars", timed({"built in place": in_place, "built apart": apart}, args.blocks, args.block)),
        ("checksum of 9 kB", timed({"google-crc32c": lambda: fast_masked_crc32c(record),
                                    "TensorBoard's loop": lambda: masked_crc32c(record)}, 4, 5)),
        ("engine: 8 prompts", timed({"left_padded": lambda: engine_prompts(token_lists, 0),
                                     "pad_sequence": lambda: engine_prompts_before(token_lists, 0)},
                                    args.blocks, args.block)),
        ("collate: 8 prompts", timed({"left_padded": lambda: left_padded(prompt_ids, 0),
                                      "pad_sequence": lambda: padded_by_pad_sequence(prompt_ids, 0)},
                                     args.blocks, args.block)),
        ("zero-variance share", timed({"tied_fraction": lambda: tied_fraction(stats["rewards"].tolist(), G),
                                       "torch": lambda: O.zero_variance_fraction(stats["rewards"], G)},
                                      args.blocks, args.block)),
        ("profiler, 95 hooks", timed({"NoProfiler": lambda: [hook_in(quiet) for _ in range(95)],
                                      "PassThrough": lambda: [hook_in(stock) for _ in range(95)]},
                                     args.blocks, args.block // 5)),
        ("sampled log-probs", timed({"sampled_logprobs": lambda: sampled_logprobs(scores, sampled),
                                     "per position": lambda: logprobs_by_position(scores, sampled)},
                                    args.blocks, args.block)),
        ("rewards of 8 groups", timed({"through numpy": score_now, "torch.as_tensor": score_before},
                                      args.blocks, args.block)),
        ("hook name, 30 sets", timed({"GMCModule": set_ours, "nn.Module": set_module}, args.blocks, args.block)),
        ("correlations", timed({"correlations": lambda: correlations(xs_fixed, stats["response_lengths"]),
                                "sixth round": lambda: correlations_before(xs_fixed, stats["response_lengths"])},
                               args.blocks, args.block)),
        ("next batch", timed({"RolloutStream": lambda: next(stream_now), "DataLoader": lambda: next(loader_before)},
                             args.blocks, args.block)),
        ("finite checks", timed({"math.isfinite": lambda: finite_floats(loss, grad_norm),
                                 "torch.isfinite": lambda: finite_tensors(loss, grad_norm)}, args.blocks, args.block)),
    ]  # fmt: skip
    print("same results checked; process CPU us per call (median of alternated blocks)")
    for label, figures in rows:
        (new, new_us), (old, old_us) = figures.items()
        print(f"  {label:22s} {new:15s} {new_us:8.1f}   {old:20s} {old_us:8.1f}   saves {old_us - new_us:7.1f}")


if __name__ == "__main__":
    main()
