"""``python -m lit_gmc export``: a checkpoint, also one written after a resume or as FSDP2's folder of shards,
becomes a loadable HF folder; anything else is one line naming ``--ckpt_path``, ``--actor`` or ``--out``."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import component, fit, main_error_line, run_subprocess, write_config
from transformers import AutoModelForCausalLM, AutoTokenizer

import lit_gmc.actor
import lit_gmc.export
from lit_gmc.actor import load_actor
from lit_gmc.errors import UserError
from lit_gmc.export import export_checkpoint

REPO = Path(__file__).resolve().parents[1]
SHARDED = (  # FSDP2 on one process, writing Lightning's distributed checkpoint (a folder of DCP shards + meta.pt)
    "--trainer.strategy", "lit_gmc.strategies.FSDP2Strategy", "--trainer.strategy.save_distributed_checkpoint", "true"
)  # fmt: skip

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


@pytest.fixture(scope="module")
def resumed_checkpoint(tmp_path_factory):
    """A tiny run checkpointed at step 2, resumed from there to step 4: its last.ckpt holds theta_4."""
    root = tmp_path_factory.mktemp("export")
    config = write_config(root, "run", total=2, every=2, schedule=component("FixedDelay", delay=1))
    fit(config)
    fit(config, "--trainer.max_steps", "4", "--ckpt_path", "last")
    path = root / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(path, weights_only=True)["global_step"] == 4
    return path


def test_export_after_a_resume_loads_with_transformers(resumed_checkpoint, tmp_path):
    out = tmp_path / "hf"
    config = resumed_checkpoint.parents[2] / "run.yaml"  # --ckpt_path last finds it through the run's config
    done = subprocess.run([sys.executable, "-m", "lit_gmc", "export", "--ckpt_path", "last", "--config", str(config),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    # (export reads --config through fit's own parser: any fit option that moves the run folder is honoured too)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"exported {resumed_checkpoint} -> {out}"
    assert out.stat().st_mode & 0o777 == 0o777 & ~lit_gmc.export.current_umask()  # as mkdir, not mkdtemp's 0o700
    for written in out.iterdir():  # as any new file (0o644 under umask 022), not safetensors' private 0o600
        assert written.stat().st_mode & 0o777 == 0o666 & ~lit_gmc.export.current_umask(), written.name
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.padding_side == "left"  # batched generation continues each prompt, not its padding
    state = torch.load(resumed_checkpoint, weights_only=True)["state_dict"]
    exported = model.state_dict()
    actor = {k.removeprefix("actor."): v for k, v in state.items() if k.startswith("actor.")}
    assert set(actor) <= set(exported)
    for name, value in actor.items():
        assert torch.equal(exported[name], value), name  # the weights after the resumed run's last update
    ids = tokenizer("12+30=", add_special_tokens=False, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "12+30="
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_export_refuses_what_it_cannot_do(resumed_checkpoint, tmp_path, monkeypatch):
    existing = tmp_path / "taken"
    existing.mkdir()
    with pytest.raises(FileExistsError, match="exports never overwrite"):
        export_checkpoint(resumed_checkpoint, existing)
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(1)}}, other)
    line = main_error_line(monkeypatch, "export", "--ckpt_path", str(other), "--out", str(tmp_path / "x"))
    assert line.startswith(f"lit_gmc: error: --ckpt_path {other} is not a lit_gmc checkpoint")
    assert not (tmp_path / "x").exists()
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")  # torch.load used to end in an UnpicklingError traceback
    with pytest.raises(UserError, match=rf"^--ckpt_path {text} is not a lit_gmc checkpoint \(torch.load cannot"):
        export_checkpoint(text, tmp_path / "y")
    with pytest.raises(UserError, match=rf"^--ckpt_path {tmp_path / 'absent.ckpt'}: no such file"):
        export_checkpoint(tmp_path / "absent.ckpt", tmp_path / "y")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(UserError, match=rf"^--out {blocked / 'hf'}: cannot write there"):
        export_checkpoint(resumed_checkpoint, blocked / "hf")


def fake_checkpoint(path: Path, actor: str, state: dict[str, torch.Tensor]) -> Path:
    """A file with what makes a lit_gmc checkpoint (resume.CHECKPOINT_KEYS): ``actor`` with ``state`` as weights."""
    torch.save({"pytorch-lightning_version": "2.6.0", "hyper_parameters": {"actor": actor}, "RolloutDataModule": {},
                "state_dict": {f"actor.{name}": value for name, value in state.items()}}, path)  # fmt: skip
    return path


def test_an_unreachable_actor_names_export_s_actor_option(tmp_path, tiny_actor_dir, monkeypatch):
    model, _ = load_actor(str(tiny_actor_dir))
    weights = {name: value + 1 for name, value in model.state_dict().items()}
    ckpt = fake_checkpoint(tmp_path / "hub.ckpt", "lit-gmc-tests/hub-model", weights)

    def unreachable(*args, **kwargs):  # what transformers raises offline
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    with monkeypatch.context() as patched:
        patched.setattr(AutoTokenizer, "from_pretrained", unreachable)  # the class lit_gmc.actor loads with
        with pytest.raises(UserError) as refused:
            export_checkpoint(ckpt, tmp_path / "hf")
    message = str(refused.value)
    assert message.startswith(f"--actor (from --ckpt_path {ckpt}) lit-gmc-tests/hub-model is no local folder")
    assert "couldn't connect" in message and "\n" not in message and "without network access" in message
    out = export_checkpoint(ckpt, tmp_path / "hf", actor=str(tiny_actor_dir))  # the local copy the message asks for
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(exported[name], value) for name, value in weights.items())
    small = fake_checkpoint(tmp_path / "small.ckpt", str(tiny_actor_dir), {"model.norm.weight": torch.ones(3)})
    with pytest.raises(UserError, match=r"its weights do not fit the actor .*model.norm.weight is \[3\], the actor's"):
        export_checkpoint(small, tmp_path / "hf2")


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory) -> Path:
    """``last.ckpt`` of a 2-update FSDP2 run on one process, saved as a folder of shards (updates that move weights)."""
    root = tmp_path_factory.mktemp("sharded")
    config = write_config(root, "run", total=2, every=2, max_new_tokens=6, group_size=8, batch_prompts=4)
    done = run_subprocess(config, *SHARDED)
    assert done.returncode == 0, done.stderr[-3000:]
    path = root / "run" / "checkpoints" / "last.ckpt"
    assert path.is_dir() and (path / "meta.pt").is_file()
    return path


def test_export_reads_a_sharded_checkpoint_folder(sharded_checkpoint, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = export_checkpoint(sharded_checkpoint, tmp_path / "hf")  # used to fail with "Is a directory"
    dcp_to_torch_save(sharded_checkpoint, tmp_path / "full.pt")  # the reference: torch's own conversion
    full = torch.load(tmp_path / "full.pt", weights_only=True)["state_dict"]
    actor = {name.removeprefix("actor."): value for name, value in full.items() if name.startswith("actor.")}
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(actor) <= set(exported) and all(torch.equal(exported[k], v) for k, v in actor.items())
    initial = load_actor("tiny")[0].state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in actor.items())  # the trained weights, not the initial ones
    # scripts/evaluate.py reads the same folder through the same function
    spec = importlib.util.spec_from_file_location("evaluate_script", REPO / "scripts" / "evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model, _, name = script.load_policy(str(sharded_checkpoint), None)
    assert name == "tiny" and all(torch.equal(model.state_dict()[k], v) for k, v in actor.items())


def test_a_sharded_checkpoint_that_cannot_be_read_is_named(sharded_checkpoint, tmp_path, tiny_actor_dir):
    meta = sharded_checkpoint / "meta.pt"
    with pytest.raises(UserError, match=rf"^--ckpt_path {meta} is the metadata of a sharded checkpoint: pass its"):
        export_checkpoint(meta, tmp_path / "hf")
    with pytest.raises(UserError, match=r"its weights do not fit the actor .*embed_tokens.weight is \[46, 128\]"):
        export_checkpoint(sharded_checkpoint, tmp_path / "hf", actor=str(tiny_actor_dir))  # hidden 32, not 128
    broken = shutil.copytree(sharded_checkpoint, tmp_path / "broken.ckpt")
    for shard in broken.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(UserError, match=rf"^--ckpt_path {broken}: its shards cannot be read \(.*No such file"):
        export_checkpoint(broken, tmp_path / "hf")
    (broken / ".metadata").unlink()
    with pytest.raises(UserError, match=rf"^--ckpt_path {broken}: its shards cannot be read"):
        export_checkpoint(broken, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_export_loads_in_vllm_and_samples_like_transformers(resumed_checkpoint, tmp_path):
    from lit_gmc.data.engines.base import SamplingParams
    from lit_gmc.data.engines.hf import HFEngine
    from lit_gmc.data.engines.vllm import VLLMEngine
    from lit_gmc.data.tasks.base import Prompt

    out = export_checkpoint(resumed_checkpoint, tmp_path / "hf")
    prompts = [Prompt(i, f"{i}+{i + 3}=", "") for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = VLLMEngine()
    engine.start(str(out))
    try:
        from_vllm = [g.response_ids[0][g.response_mask[0]].tolist() for g in engine.generate(prompts, 1, greedy)]
    finally:
        engine.close()
    reference = HFEngine()
    reference.start(str(out))
    from_hf = [g.response_ids[0][g.response_mask[0]].tolist() for g in reference.generate(prompts, 1, greedy)]
    assert from_vllm == from_hf


def test_export_s_last_without_a_checkpoint_names_the_folder_it_looked_in(tmp_path):
    from lit_gmc.export import resolved_checkpoint

    config = write_config(tmp_path, "fresh", total=2)
    with pytest.raises(UserError, match=f"--ckpt_path last: no last\\*.ckpt in {tmp_path / 'fresh' / 'checkpoints'}"):
        resolved_checkpoint("last", ["--config", str(config)])
    assert resolved_checkpoint("some.ckpt", []) == "some.ckpt"
