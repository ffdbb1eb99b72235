"""WeightSync on a real Trainer: what is published, when, under which names, and its resumable state."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from run_helpers import tiny_data

from lit_gmc.callbacks.weight_sync import WeightSync
from lit_gmc.module import GMCModule


class RecordingSink:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, torch.Tensor]]] = []

    def load_weights(self, named_tensors, version: int) -> None:
        self.calls.append((version, {name: t.clone() for name, t in named_tensors}))


def make_trainer(tmp_path, callbacks, max_steps: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(default_root_dir=tmp_path, max_steps=max_steps, max_epochs=1, accelerator="cpu", logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)  # fmt: skip


def make_pair(actor: str, steps: int):
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    module = GMCModule(actor=actor, max_response_length=4, optimizer=adamw)
    data = tiny_data(1, actor=actor, group_size=4, batch_prompts=4,
                             max_new_tokens=4, total_updates=steps)  # fmt: skip
    return module, data


def test_publishes_after_every_step_under_the_models_own_names(tmp_path):
    sink = RecordingSink()
    module, data = make_pair("tiny", 3)
    make_trainer(tmp_path, [WeightSync(sink)], 3, enable_checkpointing=False).fit(module, datamodule=data)
    assert [v for v, _ in sink.calls] == [0, 1, 2, 3]
    names = set(dict(module.actor.named_parameters()))
    assert all(set(weights) == names for _, weights in sink.calls)
    final = sink.calls[-1][1]
    for name, p in module.actor.named_parameters():
        torch.testing.assert_close(final[name], p.detach())
    # the warm-started tiny actor has reward variance, so training moved every published tensor
    assert all(not torch.equal(sink.calls[0][1][name], final[name]) for name in names)


def test_every_n_steps(tmp_path):
    sink = RecordingSink()
    module, data = make_pair("tiny", 5)
    make_trainer(tmp_path, [WeightSync(sink, every_n_steps=2)], 5, enable_checkpointing=False).fit(
        module, datamodule=data
    )
    assert [v for v, _ in sink.calls] == [0, 2, 4]


def test_default_sink_is_the_datamodules_engine(tmp_path):
    module, data = make_pair("tiny", 3)
    engine_versions = []
    data_produce = data.produce

    def produce_and_record(count):
        engine_versions.append(data.engine.version)
        return data_produce(count)

    data.produce = produce_and_record
    make_trainer(tmp_path, [WeightSync()], 3, enable_checkpointing=False).fit(module, datamodule=data)
    # fixed_delay(1), 3 updates: the fill and step 0's new batch from theta_0, step 1's from theta_1; step 2 drains
    assert engine_versions == [0, 0, 1]


def test_missing_sink_fails_clearly(tmp_path):
    module, _ = make_pair("tiny", 1)

    class NoSink(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader([0])

    with pytest.raises(TypeError, match="weight_sink"):
        make_trainer(tmp_path, [WeightSync()], 1, enable_checkpointing=False).fit(module, datamodule=NoSink())


def test_state_survives_checkpoint_and_resume(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    module, data = make_pair("tiny", 3)
    sync = WeightSync(RecordingSink(), every_n_steps=1)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    make_trainer(tmp_path, [sync, saver], 3).fit(module, datamodule=data)
    ckpt = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert torch.load(ckpt, weights_only=False)["callbacks"][sync.state_key] == {"last_synced_step": 2}
    fresh = WeightSync(RecordingSink(), every_n_steps=1)
    module2, data2 = make_pair("tiny", 3)
    make_trainer(tmp_path, [fresh], 3).fit(module2, datamodule=data2, ckpt_path=ckpt)
    # restored at step 2: re-publishes the restored weights as version 2 on start, then version 3 after the last step
    assert [v for v, _ in fresh.sink.calls] == [2, 3]
    assert fresh.last_synced_step == 3
    torch.testing.assert_close(fresh.sink.calls[0][1]["model.norm.weight"], sync.sink.calls[2][1]["model.norm.weight"])


class PolicyModule(pl.LightningModule):
    """Another project's module: its policy is ``self.policy`` (not ``self.actor``), trained on a constant batch."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = torch.nn.Linear(3, 2)
        self.head = torch.nn.Linear(2, 1)  # not part of the policy: never sent under prefix "policy."

    def training_step(self, batch, batch_idx):
        return self.head(self.policy(batch)).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def constant_batches(count: int):
    return torch.utils.data.DataLoader([torch.ones(3)] * count, batch_size=None)


def test_prefix_selects_another_projects_policy(tmp_path):
    sink, module = RecordingSink(), PolicyModule()
    make_trainer(tmp_path, [WeightSync(sink, prefix="policy.")], 2, enable_checkpointing=False).fit(
        module, constant_batches(2)
    )
    assert [v for v, _ in sink.calls] == [0, 1, 2]
    assert set(sink.calls[-1][1]) == {"weight", "bias"}
    torch.testing.assert_close(sink.calls[-1][1]["weight"], module.policy.weight.detach())
    assert not torch.equal(sink.calls[0][1]["weight"], sink.calls[-1][1]["weight"])  # the trained weights arrived
    everything = RecordingSink()
    make_trainer(tmp_path, [WeightSync(everything, prefix="")], 1, enable_checkpointing=False).fit(
        PolicyModule(), constant_batches(1)
    )
    assert set(everything.calls[-1][1]) == {"policy.weight", "policy.bias", "head.weight", "head.bias"}


def test_a_prefix_that_selects_nothing_is_an_error_before_anything_is_sent(tmp_path):
    sink = RecordingSink()
    trainer = make_trainer(tmp_path, [WeightSync(sink)], 2, enable_checkpointing=False)
    with pytest.raises(ValueError) as err:
        trainer.fit(PolicyModule(), constant_batches(2))
    message = str(err.value)
    assert "WeightSync(prefix='actor.') would send nothing" in message and "PolicyModule" in message
    assert "policy.weight" in message and "'policy.'" in message
    assert sink.calls == []


class LosingSink(RecordingSink):
    """A sink whose receivers are lost once mid-stream at ``version``: it takes one tensor, then asks for them again
    (``True``), as ``VLLMServers`` does through the DataModule; or raises instead, with ``fails``."""

    def __init__(self, version: int, fails: bool = False) -> None:
        super().__init__()
        self.version, self.fails, self.lost = version, fails, False

    def load_weights(self, named_tensors, version: int) -> bool:
        if version == self.version and not self.lost:
            self.lost = True
            next(iter(named_tensors))
            if self.fails:
                raise ConnectionError("every receiver lost")
            return True
        super().load_weights(named_tensors, version)
        return False


def test_a_sink_that_loses_its_receivers_mid_stream_is_streamed_again_and_a_failing_one_still_drained(
    tmp_path, monkeypatch
):
    """Under FSDP2 each parameter of the stream is a gather that every rank joins: rank 0 iterates the stream to its
    end whatever its sink did, so no rank is left inside a gather, and a sink asking for the weights again gets all of
    them again, at the same version (every rank streams again: ``any_rank`` agrees on it)."""
    import lit_gmc.callbacks.weight_sync as weight_sync

    gathered = []
    monkeypatch.setattr(weight_sync, "full_tensor", lambda tensor: gathered.append(tensor) or tensor)
    sink, module = LosingSink(version=1), PolicyModule()
    make_trainer(tmp_path, [WeightSync(sink, prefix="policy.")], 2, enable_checkpointing=False).fit(
        module, constant_batches(2)
    )
    assert [v for v, _ in sink.calls] == [0, 1, 2] and all(set(w) == {"weight", "bias"} for _, w in sink.calls)
    assert len(gathered) == 2 * 4  # 3 syncs of 2 parameters, the one at version 1 twice
    gathered.clear()
    failing = WeightSync(LosingSink(version=1, fails=True), prefix="policy.")
    with pytest.raises(ConnectionError, match="every receiver lost"):
        make_trainer(tmp_path, [failing], 2, enable_checkpointing=False).fit(PolicyModule(), constant_batches(2))
    assert len(gathered) == 2 * 2  # version 0, and all of version 1 although its sink stopped after one
