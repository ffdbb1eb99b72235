"""Another project's RL loop using lit_gmc's callbacks: a GRU policy, its own engine, DataModule and benchmark.

Nothing here comes from lit_gmc but the four callbacks. The project holds its policy as ``self.policy`` (so
``WeightSync`` is told ``prefix="policy."``), samples rollouts with a behaviour copy of it inside its own engine,
serves them from its own DataModule with a fixed delay, and returns from ``training_step`` the statistics
``DelayAccounting`` and ``Diagnostics`` read. ``Evaluation`` scores it on a JSONL file of its own columns with its
own template and scorer. Runs on a CPU in seconds::

    python examples/own_module/train.py --root /tmp/own_module --steps 12
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import sums
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn

from lit_gmc.callbacks.delays import DelayAccounting
from lit_gmc.callbacks.diagnostics import Diagnostics
from lit_gmc.callbacks.evaluation import BenchmarkFile, Evaluation
from lit_gmc.callbacks.weight_sync import WeightSync


class CharVocab:
    """Digits, ``+`` and ``=``, with padding and end-of-sequence tokens; decodes as a tokenizer does."""

    pad_token_id, eos_token_id = 0, 1
    tokens = ("<pad>", "<eos>", *"0123456789+=")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [self.tokens.index(char) for char in text]

    def batch_decode(self, rows: Iterable[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Text of each row; special tokens are dropped when ``skip_special_tokens`` (Evaluation asks for that)."""
        special = (self.pad_token_id, self.eos_token_id) if skip_special_tokens else ()
        return ["".join(self.tokens[i] for i in row if i not in special) for row in rows]


class GRUPolicy(nn.Module):
    """Embedding, one GRU layer, a linear head to next-token logits."""

    def __init__(self, vocab_size: int, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, ids: Tensor) -> Tensor:
        """``(R, L)`` ids to ``(R, L, V)`` next-token logits."""
        out, _ = self.gru(self.embed(ids))
        return self.head(out)

    def response_logprobs(self, prompt_ids: Tensor, response_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(R, T)`` log-probs of the response tokens and ``(R, T)`` entropies of their distributions."""
        ids = torch.cat([prompt_ids, response_ids[:, :-1]], dim=1)  # (R, P + T - 1)
        logits = self(ids)[:, prompt_ids.shape[1] - 1 :]  # (R, T, V): the positions that predict the response
        logp = torch.log_softmax(logits, dim=-1)  # (R, T, V)
        entropy = -(logp.exp() * logp).sum(-1)  # (R, T)
        return logp.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1), entropy


@dataclass
class Rollouts:
    """One update's rollouts: ``B`` prompts x ``G`` responses, rows group-major."""

    prompt_ids: Tensor  # (B*G, P)
    response_ids: Tensor  # (B*G, T), padded after end-of-sequence
    response_mask: Tensor  # (B*G, T), True on real tokens (end-of-sequence included)
    behaviour_logprobs: Tensor  # (B*G, T), 0 on padding
    rewards: Tensor  # (B*G,)
    versions: Tensor  # (B*G,), the engine's weight version that sampled each row
    group_size: int


class BehaviourEngine:
    """Samples from its own copy of the policy; the sink of ``WeightSync`` and the engine of ``Evaluation``.

    It holds no weights until the first publish (``version`` -1), and refuses to sample before: without the
    callback the rollouts could otherwise come from a policy that never learns.
    """

    def __init__(self, vocab: CharVocab, hidden: int, max_new_tokens: int) -> None:
        self.vocab, self.max_new_tokens = vocab, max_new_tokens
        self.policy = GRUPolicy(len(vocab.tokens), hidden).requires_grad_(False)
        self.version = -1
        self.loads = 0

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy every policy tensor in place; all of them must come, under the policy's own names."""
        own = dict(self.policy.named_parameters())
        received = set()
        for name, tensor in named_tensors:
            own[name].copy_(tensor)
            received.add(name)
        if received != set(own):
            raise ValueError(f"a publish must hold every policy tensor; missing {sorted(set(own) - received)}")
        self.version, self.loads = version, self.loads + 1

    @torch.no_grad()
    def sample(self, prompt: str, n: int, temperature: float, seed: int) -> tuple[Tensor, Tensor, Tensor]:
        """``n`` responses to one prompt: ``(n, T)`` ids, ``(n, T)`` mask and ``(n, T)`` behaviour log-probs."""
        if self.version < 0:
            raise RuntimeError("BehaviourEngine has no weights yet: add WeightSync(prefix='policy.') to the callbacks")
        generator = torch.Generator().manual_seed(seed)
        ids = torch.tensor([self.vocab.encode(prompt)] * n)  # (n, P)
        done = torch.zeros(n, dtype=torch.bool)
        tokens, masks, logps = [], [], []
        for _ in range(self.max_new_tokens):
            logp = torch.log_softmax(self.policy(ids)[:, -1] / max(temperature, 1e-6), dim=-1)  # (n, V)
            if temperature == 0:
                token = logp.argmax(-1)
            else:
                token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)  # (n,)
            token = torch.where(done, self.vocab.pad_token_id, token)
            tokens.append(token)
            masks.append(~done)
            logps.append(torch.where(done, 0.0, logp.gather(-1, token[:, None]).squeeze(-1)))
            done = done | (token == self.vocab.eos_token_id)
            ids = torch.cat([ids, token[:, None]], dim=1)
        return torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(logps, 1)

    def generate(self, prompts: Sequence, n: int, sampling) -> list[SimpleNamespace]:
        """Evaluation's interface: ``n`` responses to each prompt (objects with ``text``)."""
        return [
            SimpleNamespace(response_ids=self.sample(p.text, n, sampling.temperature, sampling.seed + i)[0])
            for i, p in enumerate(prompts)
        ]


class DelayedRollouts:
    """The updates' batches, each sampled ``delay`` updates before it is trained on (a FIFO, as a fixed delay).

    Sized, so that Lightning asks for each batch just before its update rather than one ahead.
    """

    def __init__(self, data: SumsDataModule, updates: int) -> None:
        self.data, self.updates = data, updates

    def __len__(self) -> int:
        return self.updates

    def __iter__(self) -> Iterator[Rollouts]:
        queue = deque(self.data.sample_batch() for _ in range(min(self.data.delay, self.updates)))
        for index in range(self.updates):
            if index + len(queue) < self.updates:  # no batch that would never be trained on
                queue.append(self.data.sample_batch())
            yield queue.popleft()


class SumsDataModule(pl.LightningDataModule):
    """Prompts, the engine and the delay; exposes ``weight_sink``, ``rollout_engine`` and ``tokenizer``."""

    def __init__(self, updates: int, batch_prompts: int = 8, group_size: int = 8, delay: int = 2, seed: int = 0):
        super().__init__()
        self.updates, self.batch_prompts, self.group_size, self.delay = updates, batch_prompts, group_size, delay
        self.seed, self.launches = seed, 0

    def setup(self, stage: str) -> None:
        """Build the engine (the callbacks find it here) and the training questions."""
        self.tokenizer = CharVocab()
        self.rollout_engine = BehaviourEngine(self.tokenizer, hidden=32, max_new_tokens=2)
        self.weight_sink = self.rollout_engine
        self.questions = sums.questions(4096, seed=self.seed)

    def sample_batch(self) -> Rollouts:
        """B prompts x G responses from the engine's current weights, with their rewards."""
        start = self.launches * self.batch_prompts
        chosen = [self.questions[(start + b) % len(self.questions)] for b in range(self.batch_prompts)]
        parts = [self.rollout_engine.sample(sums.prompt(q), self.group_size, 1.0, seed=start + b)
                 for b, (q, _) in enumerate(chosen)]  # fmt: skip
        responses = torch.cat([ids for ids, _, _ in parts])  # (B*G, T)
        texts = self.tokenizer.batch_decode(responses.tolist())
        rewards = [r for b, (_, answer) in enumerate(chosen) for r in
                   sums.exact_match(texts[b * self.group_size : (b + 1) * self.group_size], answer)]  # fmt: skip
        self.launches += 1
        prompt_ids = [self.tokenizer.encode(sums.prompt(q)) for q, _ in chosen for _ in range(self.group_size)]
        return Rollouts(
            prompt_ids=torch.tensor(prompt_ids),
            response_ids=responses,
            response_mask=torch.cat([mask for _, mask, _ in parts]),
            behaviour_logprobs=torch.cat([logp for _, _, logp in parts]),
            rewards=torch.tensor(rewards),
            versions=torch.full((len(rewards),), self.rollout_engine.version),
            group_size=self.group_size,
        )

    def train_dataloader(self) -> DelayedRollouts:
        """One batch per update (per optimizer step times the accumulation)."""
        return DelayedRollouts(self, self.updates * self.trainer.accumulate_grad_batches)


class SumsPolicy(pl.LightningModule):
    """GRPO-style update with group-mass capping: a plain LightningModule, automatic optimization.

    Args:
        hidden: GRU width.
        lr: Adam learning rate.
        cap: Group-mass cap ``eps``: a group whose mean ratio exceeds ``1 + eps`` is scaled back to it.
    """

    def __init__(self, hidden: int = 32, lr: float = 3e-2, cap: float = 0.28) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.policy = GRUPolicy(len(CharVocab.tokens), hidden)

    def training_step(self, batch: Rollouts, batch_idx: int) -> dict[str, Tensor]:
        """Loss and the statistics DelayAccounting (``delays``) and Diagnostics read."""
        logp, entropy = self.policy.response_logprobs(batch.prompt_ids, batch.response_ids)  # (N, T) each
        mask = batch.response_mask
        seq_logp = (logp * mask).sum(-1)  # (N,)
        log_rho = (seq_logp - (batch.behaviour_logprobs * mask).sum(-1)).detach()  # (N,)
        groups = log_rho.view(-1, batch.group_size)  # (B, G)
        log_rho_bar = torch.logsumexp(groups, dim=1) - math.log(batch.group_size)  # (B,)
        capped = groups - (log_rho_bar - math.log1p(self.hparams.cap)).clamp(min=0)[:, None]  # (B, G)
        rewards = batch.rewards.view(-1, batch.group_size)  # (B, G)
        advantage = rewards - (rewards.sum(1, keepdim=True) - rewards) / (batch.group_size - 1)  # leave-one-out
        loss = -((capped.exp() * advantage).flatten() * seq_logp).sum() / mask.numel()
        self.log("train/reward", batch.rewards.mean(), prog_bar=True)
        rho = groups.exp()  # (B, G)
        return {
            "loss": loss,
            "log_rho": log_rho,
            "log_rho_bar": log_rho_bar,
            "removed_mass": (rho - capped.exp()).mean(1),
            "ess": rho.sum(1) ** 2 / (rho**2).sum(1),
            "rewards": batch.rewards,
            "response_lengths": mask.sum(1),
            "delays": self.global_step - batch.versions,
            "entropy": entropy.detach()[mask],
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam on every parameter."""
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main(root: Path, steps: int = 12, accumulate_grad_batches: int = 1) -> dict:
    """Train for ``steps`` optimizer steps under ``root``; returns (and writes to ``root/summary.json``) a summary."""
    torch.manual_seed(0)
    benchmark = sums.write_benchmark(root / "sums_test.jsonl")
    evaluation = Evaluation(
        benchmarks=[BenchmarkFile(name="sums", path=str(benchmark), question="expr", answer="sum",
                                  template="{question}=", scorer="sums.exact_match", samples=4, title="Sums")],
        every_n_steps=steps // 2, at_steps=[0], ks=(1, 2, 4), max_new_tokens=2,
    )  # fmt: skip
    callbacks = [WeightSync(prefix="policy."), DelayAccounting(), Diagnostics(histogram_every_n_steps=4), evaluation]
    logger = TensorBoardLogger(str(root), name="logs", version=0)
    trainer = pl.Trainer(
        max_steps=steps, accumulate_grad_batches=accumulate_grad_batches, accelerator="cpu", logger=logger,
        callbacks=callbacks, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    model, data = SumsPolicy(), SumsDataModule(updates=steps)
    initial = copy.deepcopy(model.policy.state_dict())
    trainer.fit(model, datamodule=data)
    engine, trained = data.rollout_engine, model.policy.state_dict()
    summary = {
        "log_dir": logger.log_dir,
        "engine_version": engine.version,
        "engine_loads": engine.loads,
        "global_step": trainer.global_step,
        "engine_matches_policy": all(torch.equal(trained[k], v) for k, v in engine.policy.state_dict().items()),
        "engine_left_initial": all(not torch.equal(initial[k], v) for k, v in engine.policy.state_dict().items()),
        "evaluated_steps": evaluation.evaluated_steps,
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="folder for logs, the benchmark file and summary.json")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accumulate-grad-batches", type=int, default=1)
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    print(json.dumps(main(args.root, args.steps, args.accumulate_grad_batches), indent=2))
